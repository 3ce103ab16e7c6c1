r"""Distillation with a large vocabulary.

``chunked`` (the exact full-vocabulary losses, computed chunk by chunk from hidden states and
the LM head), ``topk`` (losses on a top-k support, with their exact bias), ``clamps`` (verl's
clamped top-k forward KL) and ``supports`` (which support each framework uses, and what it
costs). Importing this package imports none of them.
"""

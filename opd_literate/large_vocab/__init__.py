r"""Distillation with a large vocabulary.

``chunked`` (the exact full-vocabulary losses, computed chunk by chunk from hidden states and
the LM head) and ``topk`` (losses on a top-k support, with their exact bias). Importing this
package imports neither.
"""

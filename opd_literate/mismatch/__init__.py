r"""The training-inference mismatch: the sampler is not the trainer.

``toy`` (the enumerable toys), ``estimators`` (the numpy catalogue of corrections, exact on the
toys), ``opd_mismatch`` (sampled-token OPD under the mismatch) and ``correction`` (the same
catalogue on torch ``(B, T)`` batches). Importing this package imports none of them, so the
numpy modules never load torch.
"""

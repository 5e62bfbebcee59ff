"""Fake (meta) implementations of the ``sdm::`` and ``sdm_internal::`` operators: output
shapes, dtypes and strides exactly as the real implementations allocate them (contiguous), with
no data reads."""

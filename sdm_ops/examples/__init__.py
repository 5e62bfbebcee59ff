"""Applications built on the library, not part of it: ``demo`` (the main job, run as ``python
-m sdm_ops.demo``), ``mqar`` (multi-query associative recall: the task, a small model and its
compiled training) and ``tiny_lm`` (the model ``sdm_ops.serve`` exports)."""

"""``python -m sdm_ops.demo``: the main job, whose code is the example ``sdm_ops.examples.demo``
(run here as a script, so that ``--help`` prints before torch is imported)."""

import runpy

if __name__ == "__main__":
    runpy.run_module("sdm_ops.examples.demo", run_name="__main__", alter_sys=True)

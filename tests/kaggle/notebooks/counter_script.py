"""A script kernel: the counter of counter.ipynb, run as `python counter_script.py`."""

import nbresume

run = nbresume.init("script-counter", internet=False)
ckpt = run.checkpointer(every=None, async_save=False)
ckpt["total"] = 0
for step in ckpt.steps(10):
    ckpt["total"] = ckpt["total"] + step
print("step", ckpt.step, "total", ckpt["total"], "done", ckpt.done)

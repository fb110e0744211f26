"""CUDA state across a resume: bit-exact continuation with ``deterministic=True``, a GradScaler
under autocast, every device's RNG stream, models on several devices, the async snapshot
through pinned host buffers (and its fallback), a real out-of-memory error, and the preflight
on a real card.

These need an NVIDIA GPU: ``pytest -m gpu tests/gpu`` (DEVELOPERS.md). Elsewhere they are
skipped with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.gpu.conftest import requires_cuda, requires_two_gpus
from torch import nn

from nbresume import Checkpointer
from nbresume.checkpoint.state import snapshot

pytestmark = [pytest.mark.gpu, requires_cuda]

#: A small convolutional net trained on CUDA: cuDNN, cuBLAS and the CUDA RNG all take part.
TRAIN = """
import sys
import torch
from torch import nn
from nbresume import Checkpointer

folder, out, total, stop_after, amp = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "amp"
)
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 10)
).cuda()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda", enabled=amp)
data = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(1))
ckpt = Checkpointer(folder, every=None, deadline=None, quiet=True, deterministic=True,
                    model=model, optimizer=optimizer, scaler=scaler)
for step in ckpt.steps(total):
    x = data[(step * 8) % 64 : (step * 8) % 64 + 8].cuda()
    noise = torch.randn(8, 10, device="cuda")  # the CUDA RNG stream takes part
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        loss = (model(x) - noise).pow(2).mean()
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if step + 1 == stop_after:
        ckpt.request_stop("the session ends")  # saves at this boundary and leaves the loop
ckpt.close()
if ckpt.done:
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    state["scale"] = torch.tensor(scaler.get_scale())
    torch.save(state, out)
"""


def _train(tmp_path: Path, folder: Path, out: Path, stop_after: int, amp: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    done = subprocess.run(
        [sys.executable, str(script), str(folder), str(out), "12", str(stop_after),
         "amp" if amp else "fp32"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp-gradscaler"])
def test_a_deterministic_resume_is_bit_identical_on_cuda(tmp_path: Path, amp: bool) -> None:
    """Stopped after 5 of 12 steps and resumed in a new process, the run ends with exactly
    the weights (and loss scale) of a run that was never stopped."""
    whole = tmp_path / "whole.pt"
    _train(tmp_path, tmp_path / "a", whole, stop_after=-1, amp=amp)
    resumed = tmp_path / "resumed.pt"
    _train(tmp_path, tmp_path / "b", resumed, stop_after=5, amp=amp)
    assert not resumed.exists()  # the first session stopped early
    _train(tmp_path, tmp_path / "b", resumed, stop_after=-1, amp=amp)
    expected, got = torch.load(whole), torch.load(resumed)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_every_devices_rng_stream_continues(tmp_path: Path) -> None:
    devices = range(torch.cuda.device_count())
    for device in devices:
        torch.randn(1, device=f"cuda:{device}")  # CUDA started on every device
    ckpt = Checkpointer(tmp_path, every=None, deadline=None, async_save=False, quiet=True,
                        model=nn.Linear(1, 1))  # fmt: skip
    ckpt.save(block=True)
    expected = [torch.randn(16, device=f"cuda:{d}").cpu() for d in devices]
    for device in devices:
        torch.randn(1000, device=f"cuda:{device}")  # the streams move on
    ckpt.close()
    again = Checkpointer(tmp_path, every=None, deadline=None, quiet=True, model=nn.Linear(1, 1))
    again.restore()
    got = [torch.randn(16, device=f"cuda:{d}").cpu() for d in devices]
    again.close()
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)


@requires_two_gpus
def test_a_model_on_two_devices_comes_back_on_them(tmp_path: Path) -> None:
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4).to("cuda:0")
            self.second = nn.Linear(4, 2).to("cuda:1")

    model = Split()
    ckpt = Checkpointer(tmp_path, every=None, deadline=None, quiet=True, model=model)
    ckpt.save(block=True)
    ckpt.close()
    weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    fresh = Split()
    again = Checkpointer(tmp_path, every=None, deadline=None, quiet=True, model=fresh)
    again.restore()
    again.close()
    assert fresh.first.weight.device == torch.device("cuda:0")
    assert fresh.second.weight.device == torch.device("cuda:1")
    for name, value in fresh.state_dict().items():
        assert torch.equal(value.cpu(), weights[name]), name


def test_the_async_snapshot_uses_pinned_buffers_and_saves_the_step_it_copied(
    tmp_path: Path,
) -> None:
    model = nn.Linear(256, 256).cuda()
    copied, landed = snapshot.HostBuffers().copy({"model": dict(model.state_dict())})
    landed()
    assert all(t.is_pinned() for t in copied["model"].values())
    for key, value in model.state_dict().items():
        assert torch.equal(copied["model"][key], value.cpu()), key
    ckpt = Checkpointer(tmp_path, every=None, deadline=None, async_save=True, quiet=True,
                        model=model)  # fmt: skip
    ckpt.save()  # returns once copied to host memory
    saved = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the write runs
    ckpt.wait()
    ckpt.close()
    fresh = nn.Linear(256, 256).cuda()
    again = Checkpointer(tmp_path, every=None, deadline=None, quiet=True, model=fresh)
    again.restore()
    again.close()
    assert torch.equal(fresh.weight.cpu(), saved["weight"])


def test_without_pinned_memory_the_snapshot_is_still_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pinning fails in some containers (a low locked-memory limit); played by the switch the
    # first failure sets.
    monkeypatch.setattr(snapshot, "_PINNING_FAILED", ["cudaHostAlloc failed"])
    model = nn.Linear(64, 64).cuda()
    copied, landed = snapshot.HostBuffers().copy({"model": dict(model.state_dict())})
    landed()
    assert not any(t.is_pinned() for t in copied["model"].values())
    ckpt = Checkpointer(tmp_path, every=None, deadline=None, async_save=True, quiet=True,
                        model=model)  # fmt: skip
    ckpt.save()
    saved = model.weight.detach().cpu().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ckpt.wait()
    ckpt.close()
    fresh = nn.Linear(64, 64).cuda()
    again = Checkpointer(tmp_path, every=None, deadline=None, quiet=True, model=fresh)
    again.restore()
    again.close()
    assert torch.equal(fresh.weight.cpu(), saved)


@pytest.mark.slow
def test_a_real_out_of_memory_error_names_the_peak(tmp_path: Path) -> None:
    script = tmp_path / "oom.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, torch
            from torch import nn
            from nbresume import Checkpointer
            model = nn.Linear(8, 8).cuda()
            ckpt = Checkpointer(sys.argv[1], every=1, deadline=None, quiet=True, model=model)
            total = torch.cuda.get_device_properties(0).total_memory
            for step in ckpt.steps(5):
                model(torch.randn(4, 8, device="cuda")).sum().backward()
                if step == 2:
                    torch.empty(int(total * 2), dtype=torch.uint8, device="cuda")
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "OutOfMemoryError" in done.stderr
    assert "nbresume: CUDA ran out of memory at step 2" in done.stderr
    assert "GPU 0: peak" in done.stderr
    again = Checkpointer(tmp_path / "ckpt", every=None, deadline=None, quiet=True,
                         model=nn.Linear(8, 8).cuda())  # fmt: skip
    assert again.verify().ok
    assert again.restore() == 2
    again.close()


def test_the_preflight_reads_this_gpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nbresume", "doctor", "--json", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert "free of" in checks["gpu memory"]["seen"]
    assert "SM clock" in checks["gpu health"]["seen"]
    assert "last bits" in checks["determinism"]["seen"]


def gpu_copy_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, stash: bool) -> None:
    """An async save of a CUDA model, training changing it on the GPU as soon as save()
    returns: the checkpoint holds the state of the step saved, through a copy on the GPU
    first (``stash``) or straight to the host; the GPU copy's memory is given back."""
    taken: list[bool] = []
    real = snapshot._stash

    def recorded(device: Any, sources: list[Any]) -> Any:
        out = real(device, sources)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(snapshot, "_stash", recorded)
    if not stash:
        monkeypatch.setattr(snapshot, "stash_fits", lambda device, needed: False)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    before = torch.cuda.memory_allocated()
    ckpt = Checkpointer(tmp_path, every=None, deadline=None, async_save=True, quiet=True,
                        model=model)  # fmt: skip
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ckpt.save()
    with torch.no_grad():  # queued right behind the save's copy in the same stream
        for _ in range(20):
            for parameter in model.parameters():
                parameter.mul_(1.01).add_(1.0)
    ckpt.wait()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # the allocator takes back what the copy's stream freed
    assert taken == [stash]
    assert torch.cuda.memory_allocated() <= before  # the copy on the GPU was let go
    ckpt.close()
    fresh = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()
    again = Checkpointer(tmp_path, every=None, deadline=None, quiet=True, model=fresh)
    again.restore()
    again.close()
    for key, value in expected.items():
        assert torch.equal(fresh.state_dict()[key].cpu(), value), key


@requires_cuda
def test_an_async_save_copies_on_the_gpu_first_and_holds_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_copy_test(tmp_path, monkeypatch, stash=True)


@requires_cuda
def test_without_room_on_the_gpu_an_async_save_copies_to_the_host_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_copy_test(tmp_path, monkeypatch, stash=False)

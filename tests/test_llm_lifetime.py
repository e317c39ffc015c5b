"""A tensor-parallel LLM owns its workers: dropped, closed by `with`, or at exit, none is left
running and this process can open the next one; a worker whose rank 0 dies exits by itself."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
OPTIONS = dict(tensor_parallel_size=2, kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory):
    """A tiny random llama that splits over two ranks (4 heads, 2 KV heads)."""
    from tests.helpers.tiny_hf import save

    return str(save(tmp_path_factory.mktemp("lifetime"), "llama-untied"))


@pytest.fixture(autouse=True)
def _threads():
    threads = torch.get_num_threads()  # an LLM sets them (one rank's share of the cores)
    yield
    torch.set_num_threads(threads)


def alive(pid: int) -> bool:
    """Whether process pid runs: it exists and is not a zombie no one has reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def workers_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    out = []
    for p in children:
        try:
            with open(f"/proc/{p}/cmdline") as f:
                if "minerva.parallel.worker" in f.read():
                    out.append(p)
        except FileNotFoundError:
            pass
    return out


def test_a_dropped_llm_stops_its_workers(tiny_tp):
    """Created and dropped without close(), five times in one process: each is collected, its
    worker is gone and its process group left, and the next one starts and generates."""
    from minerva import LLM

    outputs = []
    for _ in range(5):
        llm = LLM(tiny_tp, **OPTIONS)
        pids = [w.pid for w in llm.group.workers]
        assert len(pids) == 1 and alive(pids[0])
        outputs.append(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        ref = weakref.ref(llm)
        del llm
        gc.collect()
        assert ref() is None  # nothing (an atexit hook, the finalizer) keeps it alive
        assert not any(alive(p) for p in pids), pids
        assert not dist.is_initialized()
    assert workers_of(os.getpid()) == []
    assert len(outputs[0]) == 4 and all(o == outputs[0] for o in outputs)


def test_with_closes_and_a_second_open_llm_is_one_error(tiny_tp):
    from minerva import LLM

    with LLM(tiny_tp, **OPTIONS) as llm:
        assert isinstance(llm, LLM)
        pids = [w.pid for w in llm.group.workers]
        with pytest.raises(MinervaError) as err:
            LLM(tiny_tp, **OPTIONS)
        message = str(err.value)
        assert "\n" not in message and "still open" in message and "llm.close()" in message, message
        assert workers_of(os.getpid()) == pids  # the refused one started no worker
        assert len(llm.generate("hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4  # still works
    assert not any(alive(p) for p in pids)
    assert not dist.is_initialized()
    llm.close()  # again: a no-op


RANK0 = r"""
import sys, time
from minerva import LLM
from minerva.engine.sampler import SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, kv_cache_memory=8 << 20)
print("WORKERS", *[w.pid for w in llm.group.workers], flush=True)
llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _wait_gone(pid: int, seconds: float) -> float:
    start = time.monotonic()
    while alive(pid) and time.monotonic() - start < seconds:
        time.sleep(0.05)
    return time.monotonic() - start


def test_an_llm_left_open_at_exit_stops_its_workers(tiny_tp):
    proc = subprocess.run([sys.executable, "-c", RANK0, tiny_tp, "end"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr, proc.stderr[-3000:]
    (pid,) = [int(p) for p in proc.stdout.split("WORKERS", 1)[1].split()]
    assert not alive(pid)


@pytest.mark.parametrize("when", ["starting", "following"])
def test_a_worker_exits_when_rank_0_is_killed(tiny_tp, when):
    """Rank 0 killed while its worker still starts (imports, loads: nothing talks to rank 0 yet)
    or follows its steps: the worker exits within seconds with one error line."""
    proc = subprocess.Popen([sys.executable, "-c", RANK0, tiny_tp, "wait"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if when == "following":
            line = proc.stdout.readline()
            assert line.startswith("WORKERS"), proc.stderr.read()[-3000:] if proc.poll() is not None else line
            (pid,) = [int(p) for p in line.split()[1:]]
            time.sleep(1.0)  # in `follow`, waiting for the next step
        else:
            deadline = time.monotonic() + 60
            while not workers_of(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.02)
            (pid,) = workers_of(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        waited = _wait_gone(pid, 60)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        assert waited < 20, f"the worker outlived its rank 0 by {waited:.0f} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()  # the worker's too: it shared rank 0's stderr
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "tensor-parallel rank 1" in errors[0] and "Traceback" not in err, err
    if when == "starting":
        assert f"rank 0 (pid {proc.pid}) is gone" in errors[0], err

"""scripts/memory_peak.py's replay of the CUDA allocator's history, on a made-up history (the
script itself needs a GPU)."""

import importlib.util
import os

from launchers import REPO

_spec = importlib.util.spec_from_file_location(
    "memory_peak", os.path.join(REPO, "scripts", "memory_peak.py"))
memory_peak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_peak)


def _frame(path, name):
    return {"filename": path, "line": 1, "name": name}


TRAIN = _frame("/x/site-packages/ddp_lab/train.py", "train_step")
ADAMW = _frame("/x/site-packages/torch/optim/adamw.py", "_multi_tensor_adamw")


def _event(action, addr, size, *frames):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


HISTORY = [
    _event("alloc", 1, 100, TRAIN),               # 100
    _event("alloc", 2, 50, ADAMW, TRAIN),         # 150
    _event("free_requested", 1, 100, TRAIN),      # still allocated until completed
    _event("alloc", 3, 30),                       # 180: the peak (no Python frame)
    _event("free_completed", 1, 100, TRAIN),      # 80
    _event("alloc", 4, 90, TRAIN),                # 170
]


def test_the_peak_is_where_allocated_bytes_are_highest_and_frees_count_when_completed():
    at = memory_peak.peak_index(HISTORY)
    assert at == 3
    live = memory_peak.live_at(HISTORY, at)
    assert sorted(b["addr"] for b in live) == [1, 2, 3]
    rows = memory_peak.by_label(live)
    assert [(r["label"], r["bytes"], r["blocks"]) for r in rows] == [
        ("ddp_lab/train.py:train_step", 100, 1),
        ("ddp_lab/train.py:train_step > torch/optim/adamw.py:_multi_tensor_adamw", 50, 1),
        (memory_peak.ENGINE, 30, 1)]


def test_a_history_without_ddp_lab_frames_is_labelled_outside():
    assert memory_peak.label([ADAMW]) == "(outside ddp_lab) > torch/optim/adamw.py:_multi_tensor_adamw"


def test_the_training_peak_is_looked_for_after_the_calibration():
    """The loop resets the peak statistics after calibrating: the script's peak is the training's
    too, found after the last allocation under time_local_backward, though the calibration's
    transient is higher."""
    calibration = _frame("/x/site-packages/ddp_lab/step.py", "time_local_backward")
    history = [_event("alloc", 9, 500, calibration),      # 500: the calibration's transient
               _event("free_completed", 9, 500, calibration)] + HISTORY
    assert memory_peak.peak_index(history) == 0
    start = memory_peak.training_start(history)
    assert start == 2 and memory_peak.peak_index(history, start) == 5  # HISTORY's peak, moved
    assert memory_peak.training_start(HISTORY) == 0

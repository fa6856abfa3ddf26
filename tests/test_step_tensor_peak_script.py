"""scripts/step_tensor_peak.py: torch's MemTracker on fake tensors, counted at a small batch."""

import importlib.util
import os

from launchers import REPO

_spec = importlib.util.spec_from_file_location(
    "step_tensor_peak", os.path.join(REPO, "scripts", "step_tensor_peak.py"))
step_tensor_peak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_tensor_peak)


def test_the_second_steps_peak_holds_the_state_and_at_least_the_saved_activations():
    """224 px AlexNet at batch 256 (fake tensors: nothing is allocated), where the peak falls in
    backward (at a small batch it falls in the optimizer step, among its temporaries): the
    parameters (61,100,840 fp32), AdamW's two moments plus its 16 step counters (4 B each), and
    activations no fewer than autograd saves for backward, all alive as backward starts
    (ddp_lab.perf.memory's count of them)."""
    from ddp_lab.perf.memory import activation_bytes, build_meta_model

    peak = step_tensor_peak.tensor_peak("alexnet", 256, channels_last=False)
    params = 61_100_840 * 4
    assert peak["param"] == params
    assert peak["opt"] == 2 * params + 16 * 4
    per_sample, fixed = activation_bytes(build_meta_model("alexnet").to_empty(device="cpu"),
                                         (3, 224, 224))
    assert peak["act"] >= per_sample * 256 + fixed
    assert peak["total"] == sum(v for k, v in peak.items() if k != "total")

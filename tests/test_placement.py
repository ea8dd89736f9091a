"""Placement with accelerate, on a CPU: the layouts computed for given GPU budgets (no GPU needed to plan), loading
and moving on a machine without GPUs, and a target dispatched with accelerate hooks (layers offloaded to the CPU
and to disk) verifying exactly under every executor."""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate import dispatch_model
from accelerate.utils import compute_module_sizes
from conftest import tiny_model, tiny_pair

from hf_ssd import SSDConfig, enable_ssd, place_models, plan_placement

pytestmark = pytest.mark.filterwarnings("ignore:Device \\d+ is not available")


def _sizes(model):
    sizes = compute_module_sizes(model)
    return sizes[""], sizes["model.layers.0"]


def test_target_across_all_gpus_but_the_last_draft_alone_on_it():
    target, draft = tiny_model("llama", layers=4, seed=0), tiny_model("llama", layers=1, seed=1)
    total, layer = _sizes(target)
    budget = int(total * 0.8)  # the target needs two GPUs (accelerate keeps room for a layer on each)
    plan = plan_placement(target, draft, gpus=[0, 1, 2], max_memory={0: budget, 1: budget, 2: budget})
    used = set(plan.target_device_map.values())
    assert used == {0, 1} and plan.draft_device == torch.device("cuda", 2) and not plan.shared_gpu
    assert not plan.offloaded and plan.target_bytes == total
    layers = [k for k in plan.target_device_map if k.startswith("model.layers.")]
    assert all(k.count(".") == 2 for k in layers)  # decoder layers are never split (no-split modules)
    roomy = plan_placement(target, draft, gpus=[3, 5], max_memory={3: 10 * total, 5: 10 * total})
    assert roomy.target_device_map == {"": 3} and roomy.draft_device == torch.device("cuda", 5)


def test_offloading_only_where_budgets_allow_it():
    target, draft = tiny_model("llama", layers=4, seed=0), tiny_model("llama", layers=1, seed=1)
    total, _ = _sizes(target)
    small = int(total * 0.4)
    with pytest.raises(ValueError, match="does not fit on GPU.*allow offloading"):
        plan_placement(target, draft, gpus=[0, 1], max_memory={0: small, 1: total})
    plan = plan_placement(target, draft, gpus=[0, 1], max_memory={0: small, 1: total, "cpu": 10 * total})
    assert plan.offloaded and "cpu" in plan.target_device_map.values() and 0 in plan.target_device_map.values()
    with pytest.raises(ValueError, match="the draft .* does not fit on GPU 1"):
        plan_placement(target, draft, gpus=[0, 1], max_memory={0: 10 * total, 1: 10})
    with pytest.raises(ValueError, match="no budget for GPU"):
        plan_placement(target, draft, gpus=[0, 1], max_memory={0: total})
    with pytest.raises(ValueError, match="distinct GPU indices"):
        plan_placement(target, draft, gpus=[0, 0], max_memory={0: total})


def test_one_gpu_is_shared_with_a_warning():
    target, draft = tiny_model("llama", layers=2, seed=0), tiny_model("llama", layers=1, seed=1)
    total, _ = _sizes(target)
    with pytest.warns(UserWarning, match="share GPU 0"):
        plan = plan_placement(target, draft, gpus=[0], max_memory={0: 10 * total})
    assert plan.shared_gpu and plan.target_device_map == {"": 0} and plan.draft_device == torch.device("cuda", 0)


def test_plans_from_folders_without_loading_weights(tmp_path):
    target, draft = tiny_model("qwen2", layers=3, seed=0), tiny_model("qwen2", layers=1, seed=1)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    total, _ = _sizes(target)
    plan = plan_placement(str(tmp_path / "target"), str(tmp_path / "draft"), gpus=[0, 1, 2],
                          max_memory={0: int(total * 0.7), 1: int(total * 0.7), 2: total})
    assert set(plan.target_device_map.values()) == {0, 1} and plan.target_bytes == total


def test_place_models_without_gpus_loads_and_enables_ssd(tmp_path):
    target, draft = tiny_pair("llama", seed=2)
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    target.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    for pair in ((target, draft), (str(tmp_path / "target"), str(tmp_path / "draft"))):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no GPU: no sharing warning
            placed_target, placed_draft = place_models(*pair, gpus=[])
        assert placed_target.device.type == placed_draft.device.type == "cpu"
        out = placed_target.generate(ids, assistant_model=placed_draft, max_new_tokens=12, do_sample=False,
                                     ssd_config=SSDConfig(lookahead=3))
        assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    """A target whose layers are spread by accelerate hooks: one on the CPU, one offloaded to disk."""
    target, draft = tiny_pair("llama", seed=4)
    reference = tiny_pair("llama", seed=4)[0]
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    hooked = dispatch_model(target, device_map=device_map, main_device="cpu",
                            offload_dir=str(tmp_path_factory.mktemp("offload")))
    assert hooked.hf_device_map == device_map
    return enable_ssd(hooked), draft, reference


@pytest.mark.parametrize("executor", ["sync", "thread", "stream", "process"])
def test_a_dispatched_target_verifies_exactly(dispatched, executor):
    hooked, draft, reference = dispatched
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    expected = reference.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    for assistant in (draft, reference):  # a small draft, and one that agrees with the target (cache hits)
        out = hooked.generate(ids, assistant_model=assistant, max_new_tokens=16, do_sample=False, pad_token_id=0,
                              ssd_config=SSDConfig(lookahead=3, executor=executor))
        assert torch.equal(out, expected)
    assert hooked.ssd_metrics.cache_hits > 0
    torch.manual_seed(7)  # sampling: the same tokens as SSD on the undispatched target for a seed
    config = SSDConfig(lookahead=3, executor=executor, backup="draft", lookahead_schedule="constant",
                       fanout_budget_schedule="constant")
    sampled = hooked.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=True, pad_token_id=0,
                              ssd_config=config)
    torch.manual_seed(7)
    plain_target = enable_ssd(reference)
    again = plain_target.generate(ids, assistant_model=draft, max_new_tokens=16, do_sample=True, pad_token_id=0,
                                  ssd_config=config)
    assert torch.equal(sampled, again)

"""ModelConfig from GGUF metadata, for each architecture family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from moechat.engine.config import ModelConfig
from moechat.engine.gguf.reader import GGUFError, GGUFFile
from moechat.engine.kernels.codes import GATING_SIGMOID, GATING_SOFTMAX_SELECTED
from moechat.engine.models import ARCHITECTURES, config_for
from testkit.ggufgen import Q, write_gguf


def _config(tmp_path: Path, arch: str, **keys: object) -> ModelConfig:
    meta = {
        f"{arch}.block_count": 4,
        f"{arch}.embedding_length": 256,
        f"{arch}.attention.head_count": 8,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.context_length": 4096,
        **{f"{arch}.{k}": v for k, v in keys.items()},
    }
    embd = {"token_embd.weight": (np.zeros((100, 256), np.float32), Q.F32)}
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, meta, embd, template=None)
    with GGUFFile(path) as f:
        return config_for(f)


def test_qwen3moe(tmp_path: Path) -> None:
    c = _config(tmp_path, "qwen3moe", expert_count=128, expert_used_count=8, expert_feed_forward_length=768,
                **{"attention.key_length": 128, "rope.freq_base": 1e6})  # fmt: skip
    assert (c.n_layers, c.n_embd, c.n_head, c.n_head_kv[0], c.head_dim) == (4, 256, 8, 2, 128)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp) == (128, 8, 768)
    assert c.is_moe and c.moe_layers == (0, 1, 2, 3)
    assert c.expert_weights_norm and c.rope_theta == 1e6 and c.n_vocab == 100


def test_qwen2moe_shared_expert(tmp_path: Path) -> None:
    c = _config(tmp_path, "qwen2moe", expert_count=60, expert_used_count=4, expert_feed_forward_length=1408,
                expert_shared_feed_forward_length=5632, expert_shared_count=1)  # fmt: skip
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp, c.n_expert_shared) == (60, 4, 1408, 5632, 1)
    assert not c.expert_weights_norm


def test_mixtral_is_llama_with_experts(tmp_path: Path) -> None:
    c = _config(tmp_path, "llama", expert_count=8, expert_used_count=2, feed_forward_length=14336)
    assert c.arch == "llama" and c.is_moe and c.n_ff_exp == 14336 and c.head_dim == 32


def test_olmoe(tmp_path: Path) -> None:
    c = _config(tmp_path, "olmoe", expert_count=64, expert_used_count=8, expert_feed_forward_length=1024)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp) == (64, 8, 1024)


def test_gpt_oss(tmp_path: Path) -> None:
    c = _config(
        tmp_path, "gpt-oss", expert_count=32, expert_used_count=4, expert_feed_forward_length=2880,
        **{"attention.sliding_window": 128, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
           "rope.scaling.original_context_length": 4096, "expert_gating_func": GATING_SIGMOID},
    )  # fmt: skip
    assert c.sliding_window == 128 and c.swa_layers == (True, False, True, False)
    assert c.rope_scaling.kind == "yarn" and c.rope_scaling.factor == 32.0 and c.rope_scaling.original_context == 4096
    assert c.expert_gating == GATING_SIGMOID  # the file's own key wins over the family's default


@pytest.mark.parametrize(
    ("arch", "field", "implicit", "written"),
    [
        ("gpt-oss", "expert_gating", GATING_SOFTMAX_SELECTED, GATING_SIGMOID),
        ("qwen3moe", "expert_weights_norm", True, False),
        ("qwen2moe", "expert_weights_norm", False, True),
        ("llama", "expert_weights_norm", True, False),
        ("qwen3next", "expert_weights_norm", True, False),
        ("olmoe", "expert_weights_norm", False, True),
    ],
)
def test_family_fills_in_what_its_files_leave_implicit(tmp_path: Path, arch: str, field: str, implicit: object,
                                                       written: object) -> None:  # fmt: skip
    key = {"expert_gating": "expert_gating_func", "expert_weights_norm": "expert_weights_norm"}[field]
    moe = {"expert_count": 8, "expert_used_count": 2}
    assert getattr(_config(tmp_path, arch, **moe), field) == implicit
    assert getattr(_config(tmp_path, arch, **moe, **{key: written}), field) == written


def test_config_knows_no_architecture_names() -> None:
    """Family quirks live in the family modules: config.py reads metadata keys only."""
    import moechat.engine.config as config_module

    source = Path(config_module.__file__).read_text()
    assert not [arch for arch in ARCHITECTURES if f'"{arch}"' in source]


def test_deepseek2_latent_attention_and_groups(tmp_path: Path) -> None:
    """DeepSeek-V3's keys as convert_hf_to_gguf writes them: MLA as one latent head, groups, YaRN multiplier."""
    c = _config(
        tmp_path, "deepseek2", expert_count=256, expert_used_count=8, expert_feed_forward_length=2048,
        expert_group_count=8, expert_group_used_count=4, expert_gating_func=GATING_SIGMOID,
        **{"attention.head_count_kv": 1, "attention.q_lora_rank": 1536, "attention.kv_lora_rank": 512,
           "attention.key_length": 576, "attention.value_length": 512, "attention.key_length_mla": 192,
           "attention.value_length_mla": 128, "rope.dimension_count": 64, "rope.scaling.type": "yarn",
           "rope.scaling.factor": 40.0, "rope.scaling.yarn_log_multiplier": 0.1},
    )  # fmt: skip
    assert (c.kv_lora_rank, c.q_lora_rank, c.head_dim, c.head_dim_v) == (512, 1536, 576, 512)
    assert (c.head_dim_mla, c.head_dim_v_mla, c.rope_dim, c.n_head_kv) == (192, 128, 64, (1,) * 4)
    assert (c.expert_groups, c.expert_groups_used) == (8, 4)
    assert abs(c.rope_scaling.yarn_log_mul - 0.1) < 1e-7


# Qwen3-Next-80B-A3B's keys as convert_hf_to_gguf writes them (Qwen3.5-35B-A3B's differ only in sizes).
_HYBRID = {
    "expert_count": 512, "expert_used_count": 10, "expert_feed_forward_length": 512,
    "expert_shared_feed_forward_length": 512, "attention.key_length": 256, "attention.value_length": 256,
    "rope.dimension_count": 64, "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.state_size": 128,
    "ssm.group_count": 16, "ssm.time_step_rank": 32, "ssm.inner_size": 4096,
}  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_hybrid_linear_attention_layers(tmp_path: Path, arch: str) -> None:
    c = _config(tmp_path, arch, **{**_HYBRID, "block_count": 8})
    assert c.recurrent == (True, True, True, False) * 2 and c.is_recurrent(0) and not c.is_recurrent(3)
    assert (c.ssm_conv_kernel, c.ssm_state, c.ssm_k_heads, c.ssm_v_heads, c.ssm_inner) == (4, 128, 16, 32, 4096)
    assert c.n_head_kv == (2,) * 8 and c.rope_dim == 64 and c.head_dim == 256
    assert c.expert_weights_norm  # the family renormalises the top-k weights; no key says so
    # A file that counts no KV heads in its linear-attention layers: the full-attention layers' count serves.
    c = _config(tmp_path, arch, **{**_HYBRID, "attention.head_count_kv": [0, 0, 0, 2]})
    assert c.n_head_kv == (2, 2, 2, 2)


def test_dense_gemma3_from_the_real_file(gemma_gguf: Path) -> None:
    with GGUFFile(gemma_gguf) as f:
        c = config_for(f)
    assert (c.arch, c.n_layers, c.n_embd, c.n_ff, c.n_vocab) == ("gemma3", 18, 640, 2048, 262144)
    assert not c.is_moe and c.head_dim == 256 and c.n_head_kv == (1,) * 18
    assert c.sliding_window == 512 and c.swa_layers.count(False) == 3 and not c.swa_layers[5]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"expert_count": 8, "expert_used_count": 9}, "expert_used_count: 9 not in 1..8"),
        ({"attention.head_count_kv": 3}, "does not divide 8 heads"),
        ({"attention.key_length": "wide"}, "expected an integer"),
        ({"expert_count": 8, "expert_used_count": 2, "expert_group_count": 3}, "3 groups .1 used. do not fit 8"),
        (
            {"expert_count": 8, "expert_used_count": 4, "expert_group_count": 4, "expert_group_used_count": 1},
            "4 groups .1 used. do not fit 8 experts with 4 used",
        ),
        (
            {"attention.kv_lora_rank": 128, "attention.key_length": 64, "rope.dimension_count": 64},
            "rope.dimension_count: 64 is not below the key length 64",
        ),
        (
            {"expert_count": 8, "expert_used_count": 2, "expert_group_count": 8, "expert_group_used_count": 2},
            "groups of 1 expert; group-limited routing needs at least 2",
        ),
        ({**_HYBRID, "ssm.time_step_rank": 3}, "do not describe linear attention"),
        ({**_HYBRID, "ssm.group_count": 0}, "do not describe linear attention"),
        ({**_HYBRID, "full_attention_interval": 0}, "full_attention_interval: must be positive"),
    ],
)
def test_bad_values(tmp_path: Path, keys: dict, message: str) -> None:
    with pytest.raises(GGUFError, match=message):
        _config(tmp_path, "qwen3moe", **keys)

"""Model catalog: the paper's Tables 3-4 models, parameter counts, TP rule, pairs and prices."""
import ast
import dataclasses
from pathlib import Path

import pytest

from shadowprefill.model import catalog
from shadowprefill.model.catalog import MODELS, PAIRS, ModelArch, get_model, get_pair, tp_degree

# Table 3 "Params (B)": total (active) per figure label; Table 4 models from their model cards.
TABLE3_PARAMS = {
    "OSS-20B": (20.9, 3.6), "OSS-120B": (116.8, 5.1), "L3.3-70B": (70.6, None), "Q2.5-7B": (7.6, None),
    "Q3N-80B": (81.3, 3.8), "L3.1-8B": (8.0, None), "L3.1-70B": (70.6, None), "M-7B": (7.2, None),
    "Nemo-12B": (12.2, None), "Mx-8x22B": (140.6, 39.1), "G2-27B": (27.2, None), "G2-9B": (9.2, None),
    "G-7B": (8.5, None), "Granite-34B": (33.7, None), "Mx-8x7B": (46.7, 12.9),
    "SWE-7B": (7.6, None), "SWE-32B": (32.8, None), "Q2.5-72B": (72.7, None),
}
# Appendix B: "7-12B models and GPT-OSS-20B on one H100; Gemma-2-27B, GPT-OSS-120B, and Granite-34B on two;
# Llama-3.x-70B and Mixtral-8x7B on four; Mixtral-8x22B and Qwen3-Next-80B-A3B on eight"; Table 4 for SWE.
PAPER_TP = {"Q2.5-7B": 1, "L3.1-8B": 1, "M-7B": 1, "Nemo-12B": 1, "G2-9B": 1, "G-7B": 1, "OSS-20B": 1,
            "G2-27B": 2, "OSS-120B": 2, "Granite-34B": 2, "L3.1-70B": 4, "L3.3-70B": 4, "Mx-8x7B": 4,
            "Mx-8x22B": 8, "Q3N-80B": 8, "SWE-7B": 1, "SWE-32B": 2, "Q2.5-72B": 4}


def test_every_table_model_is_present():
    assert {m.label for m in MODELS.values()} == set(TABLE3_PARAMS)


@pytest.mark.parametrize("label", sorted(TABLE3_PARAMS))
def test_architecture_reproduces_published_parameter_counts(label):
    arch = get_model(label)
    total, active = TABLE3_PARAMS[label]
    assert arch.params_b == total
    # Qwen3-Next's multi-token-prediction head (~1.6B) is not part of the modelled layers.
    assert arch.computed_params() / 1e9 == pytest.approx(total, rel=0.025 if label == "Q3N-80B" else 0.01)
    if active is not None:
        assert arch.active_params_b == active
        assert arch.computed_params(active=True) / 1e9 == pytest.approx(active, rel=0.07)


@pytest.mark.parametrize("label", sorted(PAPER_TP))
def test_tp_rule_matches_the_paper(label):
    assert tp_degree(get_model(label)) == PAPER_TP[label]


def test_tp_rule_on_other_memory_sizes():
    assert tp_degree(get_model("G2-27B"), hbm_bytes=141e9) == 1          # H200: 54 GB <= 70.5 GB
    assert tp_degree(get_model("L3.1-70B"), hbm_bytes=141e9) == 4        # 141.2 GB > 2 x 70.5 GB
    with pytest.raises(ValueError, match="do not fit"):
        tp_degree(get_model("Mx-8x22B"), hbm_bytes=40e9)


def test_pairs_follow_the_figures():
    assert {w: len(p) for w, p in PAIRS.items()} == {"xroutebench": 5, "fusionbench": 5, "router-r1": 6,
                                                    "ghcp-coding": 6, "swe-bench": 2}
    for workload, pairs in PAIRS.items():
        for label, (small, large) in pairs.items():
            s, l = label.split("/")
            assert (get_model(s).name, get_model(l).name) == (small, large)
            # Table 3: "Small and large are by total parameters"
            assert MODELS[small].params_b < MODELS[large].params_b, label
    assert get_pair("Q2.5-7B/L3.1-70B") == ("Qwen2.5-7B", "Llama-3.1-70B")
    assert get_pair("S7/Q72", "swe-bench") == ("SWE-agent-LM-7B", "Qwen2.5-72B")
    assert get_pair("Q7/L70") == get_pair("Q2.5-7B/L3.1-70B")
    with pytest.raises(ValueError, match="not among"):
        get_pair("S7/Q72", "fusionbench")
    with pytest.raises(ValueError, match="SMALL/LARGE"):
        get_pair("Q2.5-7B")


def test_lookup_by_key_label_alias_and_hf_id():
    assert get_model("Llama-3.1-8B") is get_model("L3.1-8B") is get_model("L8") \
        is get_model("meta-llama/llama-3.1-8b-instruct")
    with pytest.raises(ValueError, match="unknown model"):
        get_model("GPT-17")
    with pytest.raises(TypeError):
        get_model(7)


def test_token_cost_bills_cached_input_at_a_tenth():
    arch = get_model("L3.1-70B")
    full = arch.token_cost(10_000, 0, 200)
    cached = arch.token_cost(10_000, 8_000, 200)
    assert full == pytest.approx((10_000 * arch.price_input + 200 * arch.price_output) / 1e6)
    assert full - cached == pytest.approx(8_000 * arch.price_input * 0.9 / 1e6)
    with pytest.raises(ValueError, match="cached_tokens"):
        arch.token_cost(10, 11, 1)


def test_kv_and_weight_bytes():
    assert get_model("G-7B").kv_bytes_per_token() == 458752                   # paper §3.3: 458 KB
    assert get_model("L3.1-8B").kv_bytes_per_token() == 131072
    oss = get_model("OSS-120B")                                                 # MXFP4 experts
    assert oss.weight_bytes() < 0.6 * oss.params_b * 2e9
    assert get_model("L3.1-70B").weight_bytes() == pytest.approx(70.6e9 * 2)


def test_validation_names_the_field():
    base = get_model("L3.1-8B")
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(base, num_kv_heads=5)
    with pytest.raises(ValueError, match="hidden_size"):
        dataclasses.replace(base, hidden_size=0)
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(base, sliding_window_layers=4)
    assert isinstance(base, ModelArch)


def test_catalog_module_does_not_import_torch():
    tree = ast.parse(Path(catalog.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module.split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported

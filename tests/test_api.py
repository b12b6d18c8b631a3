"""The package's public API: the names at its top level, importable without torch until used."""

import subprocess
import sys

import pytest

import roads_to_rome
from roads_to_rome import Engine, EntropyPolicy, SamplingParams
from roads_to_rome.errors import R2RError


def test_every_public_name_resolves():
    for name in roads_to_rome.__all__:
        assert getattr(roads_to_rome, name).__name__ == name


def test_importing_the_package_imports_no_torch():
    code = "import sys, roads_to_rome; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_the_public_names_run_a_pair(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(0.0))  # entropy >= 0 always: every token from the LLM
    result = engine.generate([engine.prompts.raw("a b c")], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    alone = Engine.alone(llm, tokenizer).generate([engine.prompts.raw("a b c")],
                                                  SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert result.token_ids == alone.token_ids and result.llm_rate == 1.0


def test_load_engine_builds_what_a_config_says_and_fields_override_it(tmp_path):
    from tiny import save_pair

    from roads_to_rome import EngineConfig, load_engine
    from roads_to_rome.hardware import has_native_bf16

    slm_dir, llm_dir = save_pair(tmp_path)
    config = EngineConfig(slm=str(slm_dir), llm=str(llm_dir), device="cpu", policy="entropy", threshold=0.5)
    engine = load_engine(config, verify="strict", max_unverified=3)
    assert (engine.policy.name, engine.policy.threshold, engine.verify.value, engine.max_unverified) == \
        ("entropy", 0.5, "strict", 3)
    assert config.verify is None and config.max_unverified is None  # the config is left as it was made
    assert load_engine(config).verify.value == 1.0  # a routing policy verifies at 1 nat unless told otherwise
    # grouped LLM calls: auto groups where the LLM's grouped reads are cheap (torch in bf16 on a CPU with native
    # bf16), else lockstep; a mode and its rule as asked; checked before loading
    assert load_engine(config, dtype="float32").deferral.mode == "off"
    assert load_engine(config, dtype="bfloat16").deferral.mode == ("continue" if has_native_bf16() else "off")
    rule = load_engine(config, defer="continue", defer_group=0.5, defer_steps=4).deferral
    assert (rule.mode, rule.group, rule.steps) == ("continue", 0.5, 4)
    with pytest.raises(R2RError, match="--defer off groups none"):  # a share of rows where nothing is grouped
        load_engine(config, defer="off", defer_group=0.5)
    assert load_engine(config, policy="llm", threshold=None, defer=None).deferral.mode == "off"
    # where one model writes every token, a setting of routed tokens would be read by nothing: refused, not ignored
    with pytest.raises(R2RError, match="--threshold sets how routed tokens go to the LLM; --router llm"):
        load_engine(config, policy="llm")
    with pytest.raises(R2RError, match="--defer, --defer-steps, --overlap set .* --router slm .* leave them out"):
        load_engine(config, policy="slm", threshold=None, defer="continue", defer_steps=3, overlap="on")
    assert load_engine(config, policy="slm", threshold=None, defer="off", overlap="auto").policy.name == "slm"
    # ... but the SLM drafting alone for the LLM to check (speculative decoding) overlaps the two as asked
    spec = load_engine(config, policy="slm", threshold=None, verify="strict", max_unverified=4, overlap="on")
    assert spec.overlap and not load_engine(config, policy="slm", threshold=None, verify="strict").overlap
    with pytest.raises(R2RError, match="--overlap sets .* --router llm"):
        load_engine(config, policy="llm", threshold=None, overlap="on")
    with pytest.raises(R2RError, match="--overlap sets .* --router slm .* or have the LLM check the SLM's tokens"):
        load_engine(config, policy="slm", threshold=None, overlap="on")
    with pytest.raises(R2RError, match="nothing for it to check"):  # the LLM would read every token twice
        load_engine(config, policy="llm", threshold=None, verify="strict")
    with pytest.raises(R2RError, match="defer takes"):
        load_engine(config, defer="sometimes", slm="/nowhere")

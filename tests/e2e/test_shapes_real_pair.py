"""A shape of another size beside the real default SLM: its padded vocabulary pairs with the SLM's tokenizer,
and the default SLM with any LLM gets the shipped router and verification at 1 nat."""

import pytest

from roads_to_rome.bench import shape_models
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.models import DEFAULT_LLM, DEFAULT_SLM, gguf_path, is_prepared, load_engine

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not is_prepared(DEFAULT_SLM) or not gguf_path(DEFAULT_LLM).exists(),
                                                  reason="the default pair is not prepared (`r2r models prepare`)")]
# The real vocabulary padded to 152,064 rows as the 7B and larger Qwen2.5 models have it; small everywhere else.
PADDED = shape_models.LlmShape("padded", "test", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512,
                               vocab_rows=152064, tied=False)


@pytest.fixture(scope="module")
def padded_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("padded")
    return shape_models.quantize(shape_models.write_random_gguf(PADDED, gguf_path(DEFAULT_LLM), folder / "f16.gguf"),
                                 folder / "padded.gguf")


def test_the_default_slm_with_another_llm_gets_the_shipped_router_and_verification(padded_file):
    engine = load_engine(llm=str(padded_file), backend="llamacpp")  # tokenizers compared: the padding rows differ
    assert engine.policy.name == "router" and engine.verify.value == 1.0
    assert engine.llm.vocab_size == engine.slm.vocab_size == len(engine.tokenizer)
    prompt = engine.prompts.chat("What is 48 / 2?")
    gen = engine.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert len(gen.token_ids) == 24 and all(t < len(engine.tokenizer) for t in gen.token_ids)
    assert gen.llm_tokens > 0  # random weights disagree with the SLM: verification sends fixes

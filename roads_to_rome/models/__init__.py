"""Models: the default pair and its shipped router (`packaged`), and loading any pair into an engine (`loading`)."""

from roads_to_rome.backends import BACKENDS
from roads_to_rome.models.loading import (
    DTYPES,
    EngineConfig,
    choose_policy,
    load_alone,
    load_engine,
    load_model,
    load_pair,
    parse_backends,
    pick_device,
    read_chat_template,
    resolve,
    router_path_for,
    same_tokenizer,
    template_hash,
)
from roads_to_rome.models.packaged import (
    DEFAULT_LLM,
    DEFAULT_PAIR,
    DEFAULT_SLM,
    PackagedModel,
    assemble_gguf,
    bf16_dir,
    cache_dir,
    convert_gguf,
    converted_dir,
    gguf_path,
    install_parts,
    is_converted,
    is_prepared,
    prepare,
    shipped_router,
    tokenizer_dir,
    tokenizer_source,
)

__all__ = ["BACKENDS", "DTYPES", "EngineConfig", "choose_policy", "load_alone", "load_engine", "load_model",
           "load_pair", "parse_backends", "pick_device", "read_chat_template", "resolve", "router_path_for",
           "same_tokenizer", "template_hash",
           "DEFAULT_LLM", "DEFAULT_PAIR", "DEFAULT_SLM", "PackagedModel", "assemble_gguf", "bf16_dir", "cache_dir",
           "convert_gguf", "converted_dir", "gguf_path", "install_parts", "is_converted", "is_prepared", "prepare",
           "shipped_router", "tokenizer_dir", "tokenizer_source"]

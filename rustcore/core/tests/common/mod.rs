//! Fixtures shared by the integration tests: the graph IR files in `tests/fixtures/`
//! (written by `tests/fixtures/make_fixtures.py`, also read by the Python tests).

/// The bytes of `tests/fixtures/<name>.hapg`.
#[allow(unused_macros)]
macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/", $name, ".hapg")) as &[u8]
    };
}

/// Every benchmark model, exported at tiny size with batch 2.
#[allow(dead_code)]
pub const MODELS: &[(&str, &[u8])] = &[
    ("mlp", fixture!("mlp")),
    ("vgg19", fixture!("vgg19")),
    ("vit", fixture!("vit")),
    ("bert", fixture!("bert")),
    ("bert_moe", fixture!("bert_moe")),
    ("gpt2_block", fixture!("gpt2_block")),
    ("llama_block", fixture!("llama_block")),
];

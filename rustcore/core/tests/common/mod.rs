//! Fixtures shared by the integration tests: the graph IR files in `tests/fixtures/`
//! (written by `tests/fixtures/make_fixtures.py`, also read by the Python tests), and
//! a one-host test profile.

use hapd_core::profile::{CollectiveCost, Collectives, Device, Link, Profile};

/// The bytes of `tests/fixtures/<name>.hapg`.
#[allow(unused_macros)]
macro_rules! fixture {
    ($name:literal) => {
        include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/", $name, ".hapg")) as &[u8]
    };
}

/// `(name, bytes)` of each named fixture, in order.
#[allow(unused_macros)]
macro_rules! fixtures {
    ($($name:literal),* $(,)?) => {
        &[$(($name, fixture!($name))),*]
    };
}

/// Every benchmark model, exported at tiny size with batch 2.
#[allow(dead_code)]
pub const MODELS: &[(&str, &[u8])] = fixtures!["mlp", "vgg19", "vit", "bert", "bert_moe", "gpt2_block", "llama_block"];

/// A one-host profile: one device per entry of `flops`, 16 GiB each, and the same
/// α (s) / β (bytes/s) for every collective.
#[allow(dead_code)]
pub fn profile(flops: &[f64], alpha: f64, beta: f64) -> Profile {
    let cost = CollectiveCost { inter: Link { alpha, beta }, intra: None };
    Profile {
        name: "test".into(),
        devices: flops
            .iter()
            .enumerate()
            .map(|(i, &f)| Device {
                rank: i as u32,
                host: "h0".into(),
                model: "test".into(),
                flops: f,
                elementwise_flops: None,
                memory: 16.0 * (1u64 << 30) as f64,
                fused_attention: false,
            })
            .collect(),
        collectives: Collectives {
            all_gather: cost,
            all_gather_grouped: cost,
            reduce_scatter: cost,
            reduce_scatter_grouped: cost,
            all_reduce: cost,
            all_to_all: cost,
            broadcast: cost,
            grad_sync: None,
            p2p: None,
        },
    }
}

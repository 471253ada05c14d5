//! The cluster profile as the core sees it: devices and the α-β cost of each
//! collective. Python validates the JSON file (`hapd/profile/schema.py`) and hands the core a
//! normalized msgpack map; the core checks what it relies on again.

use serde::Deserialize;

use crate::error::{Error, Result};

/// One device (one rank).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Device {
    pub rank: u32,
    pub host: String,
    #[serde(default)]
    pub model: String,
    /// Achieved FLOP/s on matmul-heavy work.
    pub flops: f64,
    /// Achieved FLOP/s on element-wise work (defaults to `flops`).
    #[serde(default)]
    pub elementwise_flops: Option<f64>,
    /// Memory in bytes.
    pub memory: f64,
    /// Whether the device runs hapd's fused attention kernel (CUDA with Triton, compute
    /// capability ≥ 7.0): an attention with dropout then keeps nothing of size
    /// queries × keys and draws its mask again in the backward pass. False (absent):
    /// the math attention, the probabilities materialized.
    #[serde(default)]
    pub fused_attention: bool,
}

/// Latency (s) and bandwidth (bytes/s, counted over the full tensor) of one collective.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Link {
    pub alpha: f64,
    pub beta: f64,
}

/// Intra-host and inter-host costs of one collective (`intra` defaults to `inter`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct CollectiveCost {
    pub inter: Link,
    #[serde(default)]
    pub intra: Option<Link>,
}

/// Every collective kind the cost model uses.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Collectives {
    pub all_gather: CollectiveCost,
    pub all_gather_grouped: CollectiveCost,
    pub reduce_scatter: CollectiveCost,
    pub reduce_scatter_grouped: CollectiveCost,
    pub all_reduce: CollectiveCost,
    pub all_to_all: CollectiveCost,
    pub broadcast: CollectiveCost,
    /// The all-reduce of replicated gradients' buckets as the runtime runs it across
    /// hosts (two-level); `all_reduce` where the profile does not give it.
    #[serde(default)]
    pub grad_sync: Option<CollectiveCost>,
    /// One message from one rank to another (`send`/`recv`), for moving activations
    /// between pipeline stages; not priced by the SPMD search.
    #[serde(default)]
    pub p2p: Option<CollectiveCost>,
}

/// A cluster profile.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Profile {
    #[serde(default)]
    pub name: String,
    pub devices: Vec<Device>,
    pub collectives: Collectives,
}

impl Profile {
    pub fn from_msgpack(bytes: &[u8]) -> Result<Profile> {
        let profile: Profile = rmp_serde::from_slice(bytes)
            .map_err(|e| Error::InvalidProfile { field: "<document>".into(), message: e.to_string() })?;
        profile.check()?;
        Ok(profile)
    }

    pub fn world(&self) -> usize {
        self.devices.len()
    }

    /// Whether the devices span more than one host (collectives then use `inter`).
    pub fn multi_host(&self) -> bool {
        self.devices.iter().any(|d| d.host != self.devices[0].host)
    }

    /// Whether the cost model prices an attention with dropout as hapd's fused kernel
    /// ([`crate::rules::fused_attention_flops`], nothing of size queries × keys kept):
    /// only when every device runs it. A plan's step lasts as long as its slowest rank's,
    /// and a rank running the math attention keeps its probabilities, so a mixed cluster
    /// keeps the math pricing on every rank (pricing each device by its own path is left
    /// for later).
    pub fn fused_attention(&self) -> bool {
        !self.devices.is_empty() && self.devices.iter().all(|d| d.fused_attention)
    }

    /// The link a collective over all devices runs on.
    pub fn link(&self, cost: &CollectiveCost) -> Link {
        if self.multi_host() {
            cost.inter
        } else {
            cost.intra.unwrap_or(cost.inter)
        }
    }

    fn check(&self) -> Result<()> {
        let bad = |field: String, message: String| Err(Error::InvalidProfile { field, message });
        if self.devices.is_empty() {
            return bad("devices".into(), "no devices".into());
        }
        for (i, d) in self.devices.iter().enumerate() {
            if d.rank as usize != i {
                return bad(format!("devices[{i}].rank"), format!("{} but devices must be listed in rank order", d.rank));
            }
            let speeds = [("flops", Some(d.flops)), ("elementwise_flops", d.elementwise_flops)];
            for (name, value) in speeds {
                if let Some(v) = value {
                    if !(v.is_finite() && v > 0.0) {
                        return bad(format!("devices[{i}].{name}"), format!("{v} is not a positive FLOP/s"));
                    }
                }
            }
            if !(d.memory.is_finite() && d.memory > 0.0) {
                return bad(format!("devices[{i}].memory"), format!("{} is not a positive byte count", d.memory));
            }
        }
        let c = &self.collectives;
        let all = [
            ("all_gather", &c.all_gather),
            ("all_gather_grouped", &c.all_gather_grouped),
            ("reduce_scatter", &c.reduce_scatter),
            ("reduce_scatter_grouped", &c.reduce_scatter_grouped),
            ("all_reduce", &c.all_reduce),
            ("all_to_all", &c.all_to_all),
            ("broadcast", &c.broadcast),
        ];
        let optional = [("grad_sync", c.grad_sync.as_ref()), ("p2p", c.p2p.as_ref())]
            .into_iter()
            .filter_map(|(name, cost)| cost.map(|cost| (name, cost)));
        for (name, cost) in all.into_iter().chain(optional) {
            for (which, link) in [("inter", Some(cost.inter)), ("intra", cost.intra)] {
                let Some(link) = link else { continue };
                if !(link.alpha.is_finite() && link.alpha >= 0.0) {
                    return bad(format!("collectives.{name}.{which}.alpha"), format!("{} is not a latency ≥ 0 s", link.alpha));
                }
                if !(link.beta.is_finite() && link.beta > 0.0) {
                    return bad(format!("collectives.{name}.{which}.beta"), format!("{} is not a bandwidth > 0 bytes/s", link.beta));
                }
            }
        }
        Ok(())
    }
}

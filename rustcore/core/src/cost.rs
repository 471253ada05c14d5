//! The cost model: per-device times linear in the sharding ratios.
//!
//! A [`Row`] gives, for every device `d`, `constant[d] + coef[d] · r[d]` seconds, where
//! `r[d]` is device `d`'s sharding ratio. A step costs `max_d comp + max_d comm`; a
//! program costs the sum over its steps (bulk-synchronous, no overlap). The memory
//! model, rows of bytes in the same form, is [`crate::memory`]. [`RowOut`] is a row on
//! the wire (in plans and overlap schedules).

use serde::Serialize;

use crate::profile::Profile;

/// Seconds per device, linear in that device's sharding ratio.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    pub constant: Vec<f64>,
    pub coef: Vec<f64>,
}

impl Row {
    pub fn zeros(devices: usize) -> Row {
        Row { constant: vec![0.0; devices], coef: vec![0.0; devices] }
    }

    /// `self += other`.
    pub fn add(&mut self, other: &Row) {
        for (a, b) in self.constant.iter_mut().zip(&other.constant) {
            *a += b;
        }
        for (a, b) in self.coef.iter_mut().zip(&other.coef) {
            *a += b;
        }
    }

    /// Seconds on each device under `ratios`.
    pub fn values(&self, ratios: &[f64]) -> Vec<f64> {
        self.constant.iter().zip(&self.coef).zip(ratios).map(|((c, k), r)| c + k * r).collect()
    }

    /// Max over devices under `ratios`.
    pub fn max(&self, ratios: &[f64]) -> f64 {
        self.values(ratios).into_iter().fold(0.0, f64::max)
    }

    pub fn is_zero(&self) -> bool {
        self.constant.iter().chain(&self.coef).all(|v| *v == 0.0)
    }
}

/// A cost row on the wire: per device `constant[d] + coef[d] · r[d]` seconds (or bytes).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowOut {
    pub constant: Vec<f64>,
    pub coef: Vec<f64>,
}

impl From<&Row> for RowOut {
    fn from(row: &Row) -> Self {
        RowOut { constant: row.constant.clone(), coef: row.coef.clone() }
    }
}

/// Which achieved FLOP/s of a device an op's work runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkClass {
    /// Dense linear algebra: linear, matmul, einsum, convolution, attention.
    Matmul,
    /// Everything else: element-wise, normalization, reductions, data movement.
    Elementwise,
}

/// How an op's work divides among devices under one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Every device does all the work (replicated compute, or partial-sum inputs).
    Full,
    /// Device `d` does fraction `r[d]` of the work.
    Sharded,
    /// No work (views and other free ops).
    Free,
}

/// Compute-time row of an op: forward + backward (2× forward) FLOPs when it carries a
/// gradient, forward only otherwise.
pub fn compute_row(profile: &Profile, flops: f64, class: WorkClass, work: Work, with_grad: bool) -> Row {
    let n = profile.world();
    let mut row = Row::zeros(n);
    if work == Work::Free || flops <= 0.0 {
        return row;
    }
    let total = if with_grad { 3.0 * flops } else { flops };
    for (d, device) in profile.devices.iter().enumerate() {
        let speed = match class {
            WorkClass::Matmul => device.flops,
            WorkClass::Elementwise => device.elementwise_flops.unwrap_or(device.flops),
        };
        match work {
            Work::Full => row.constant[d] = total / speed,
            Work::Sharded => row.coef[d] = total / speed,
            Work::Free => {}
        }
    }
    row
}

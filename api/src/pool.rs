//! Pools of devices as the mediator's API (`POST /pools`, `PATCH
//! /pools/NAME`), its config file (`[[pools]]`) and `vgpuctl pool`
//! describe them, and the checks of a description that need nothing but
//! the description.

use serde::{Deserialize, Serialize};

use crate::tenant::validate_name;

/// The largest overcommit ratio a pool may have.
pub const MAX_OVERCOMMIT: f64 = 16.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Access {
    /// Any tenant may be placed in the pool.
    #[default]
    Public,
    /// Only the tenants on the pool's allow-list.
    Private,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Fill the fullest device that still fits, leaving whole devices free.
    Pack,
    /// Use the device with the most unreserved memory, spreading load.
    #[default]
    Spread,
}

/// How the tenants of a pool share each of its GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum, utoipa::ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Sharing {
    /// One tenant's executor on the GPU at a time, granted by weight: a
    /// fault or a runaway kernel ends only its own tenant's work.
    #[default]
    TimeSliced,
    /// NVIDIA's Multi-Process Service, for tenants that trust each other:
    /// their kernels run on the GPU at once, each on at most its share of
    /// the SMs, but one tenant's fatal fault fails every tenant's work on
    /// that GPU. GPUs (and MIG instances) only.
    Mps,
}

/// A pool, as the config file (`[[pools]]`) and `POST /pools` describe it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    #[schema(pattern = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$", example = "pool-a")]
    pub name: String,
    /// Device names (`cpu0`, a GPU's or MIG instance's name).
    #[schema(min_items = 1)]
    pub devices: Vec<String>,
    /// Who may be placed in the pool.
    #[serde(default)]
    #[schema(default = "public")]
    pub access: Access,
    /// Tenant names a private pool admits (at most 4096).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(max_items = 4096)]
    pub allow: Vec<String>,
    /// pack: the fullest device that fits; spread: the freest.
    #[serde(default)]
    #[schema(default = "spread")]
    pub placement: Placement,
    /// Quotas placed on each device may add up to this times its memory
    /// (1: no overcommit). What does not fit in device memory spills to
    /// the device's host spill budget.
    #[serde(default = "one")]
    #[schema(minimum = 1, maximum = 16, default = 1)]
    pub overcommit: f64,
    /// time-sliced: tenants take turns on each GPU and are isolated from
    /// each other's faults; mps: they run at once under NVIDIA's MPS and
    /// share its fate (trusted tenants only). Set when the pool is made.
    #[serde(default)]
    #[schema(default = "time-sliced")]
    pub sharing: Sharing,
}

fn one() -> f64 {
    1.0
}

/// What `PATCH /pools/NAME` may change; absent fields stay.
#[derive(Debug, Clone, Default, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolChange {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub access: Option<Access>,
    /// Replaces the allow-list.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 16)]
    pub overcommit: Option<f64>,
}

pub fn check_overcommit(pool: &str, r: f64) -> Result<(), String> {
    if !(1.0..=MAX_OVERCOMMIT).contains(&r) {
        return Err(format!("pool {pool}: overcommit must be a ratio from 1 to {MAX_OVERCOMMIT}, not {r}"));
    }
    Ok(())
}

impl PoolSpec {
    /// Checks the description on its own (the devices' existence is the
    /// control plane's check).
    pub fn validate(&self) -> Result<(), String> {
        validate_name(&self.name).map_err(|e| format!("pool: {e}"))?;
        if self.devices.is_empty() {
            return Err(format!("pool {}: list at least one device", self.name));
        }
        let mut seen = std::collections::BTreeSet::new();
        for d in &self.devices {
            if !seen.insert(d) {
                return Err(format!("pool {}: device {d} is listed twice", self.name));
            }
        }
        self.check_access()?;
        check_overcommit(&self.name, self.overcommit)
    }

    pub fn check_access(&self) -> Result<(), String> {
        if self.access == Access::Public && !self.allow.is_empty() {
            return Err(format!("pool {}: an allow-list only applies to a private pool (access = \"private\")", self.name));
        }
        if self.allow.len() > 4096 {
            return Err(format!("pool {}: at most 4096 tenants on an allow-list", self.name));
        }
        for t in &self.allow {
            validate_name(t).map_err(|e| format!("pool {} allow-list: {e}", self.name))?;
        }
        Ok(())
    }

    /// Whether tenant `name` may be placed here.
    pub fn admits(&self, name: &str) -> bool {
        self.access == Access::Public || self.allow.iter().any(|a| a == name)
    }

    /// The quotas a device of `memory` bytes may hold in this pool.
    pub fn capacity(&self, memory: u64) -> u64 {
        (memory as f64 * self.overcommit).min(u64::MAX as f64) as u64
    }
}

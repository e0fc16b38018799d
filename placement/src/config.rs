//! `ParallelConfig`: the degrees of each kind of parallelism, parsed from a string such as
//! `dp=2,tp=2,sp` and validated with one-line errors.

use crate::axis::{AxisKind, AxisRole};
use crate::error::{Error, Result};
use crate::mesh::Mesh;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Degrees of parallelism. `world_size() = pp·dp·ep·cp·tp`: every degree is a mesh axis of
/// its own. Expert parallelism shards the experts over `ep` and, outside the experts, `ep`
/// shards the tokens as `dp` does, so dense layers are data-parallel over `dp·ep` ranks
/// (Megatron-Core folds `ep` into its data-parallel degree instead: its `dp=4, ep=2` is
/// our `dp=2, ep=2`). `sp` (sequence parallelism) shards activations along the sequence
/// over the TP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ParallelConfig {
    /// Data-parallel degree: ranks holding replicas of the dense parameters (ZeRO/FSDP
    /// shard them over this axis). At least 1.
    pub dp: usize,
    /// Tensor-parallel degree: ranks splitting each matmul (the innermost axis, adjacent
    /// ranks). At least 1.
    pub tp: usize,
    /// Pipeline-parallel degree: stages the layers are cut into (the outermost axis). At
    /// least 1.
    pub pp: usize,
    /// Context-parallel degree: ranks splitting each sequence (ring attention). At least 1.
    pub cp: usize,
    /// Expert-parallel degree: ranks the MoE experts are spread over; outside the experts
    /// it shards tokens like `dp`. At least 1.
    pub ep: usize,
    /// Sequence parallelism: activations outside the matmuls are `Shard` along the
    /// sequence over `Tp` instead of whole. Needs `tp` > 1.
    pub sp: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        ParallelConfig {
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            ep: 1,
            sp: false,
        }
    }
}

impl ParallelConfig {
    /// Parses `key=value` pairs and flags separated by commas: keys `dp`, `tp`, `pp`, `cp`,
    /// `ep` (positive integers, default 1) and the flag `sp`. The result is validated.
    pub fn parse(input: &str) -> Result<ParallelConfig> {
        let err = |detail: String| Error::InvalidConfig {
            input: input.to_string(),
            detail,
        };
        let mut cfg = ParallelConfig::default();
        let mut seen: Vec<&str> = Vec::new();
        for item in input.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (item, None),
            };
            if seen.contains(&key) {
                return Err(err(format!("`{key}` given twice")));
            }
            seen.push(key);
            if key == "sp" {
                match value {
                    None | Some("true") | Some("1") => cfg.sp = true,
                    Some("false") | Some("0") => cfg.sp = false,
                    Some(v) => {
                        return Err(err(format!("`sp` takes no value or true/false, got `{v}`")))
                    }
                }
                continue;
            }
            let slot = match key {
                "dp" => &mut cfg.dp,
                "tp" => &mut cfg.tp,
                "pp" => &mut cfg.pp,
                "cp" => &mut cfg.cp,
                "ep" => &mut cfg.ep,
                _ => {
                    return Err(err(format!(
                        "unknown key `{key}` (expected dp, tp, pp, cp, ep or sp)"
                    )))
                }
            };
            let value =
                value.ok_or_else(|| err(format!("`{key}` needs a value, as in `{key}=2`")))?;
            let n: usize = value
                .parse()
                .map_err(|_| err(format!("`{key}={value}` is not a positive integer")))?;
            if n == 0 {
                return Err(err(format!("`{key}` must be at least 1, got 0")));
            }
            *slot = n;
        }
        cfg.validate().map_err(|e| match e {
            Error::InvalidConfig { detail, .. } => err(detail),
            other => other,
        })?;
        Ok(cfg)
    }

    /// Checks the rules that involve several degrees.
    pub fn validate(&self) -> Result<()> {
        let err = |detail: String| Error::InvalidConfig {
            input: self.to_string(),
            detail,
        };
        for (name, v) in [
            ("dp", self.dp),
            ("tp", self.tp),
            ("pp", self.pp),
            ("cp", self.cp),
            ("ep", self.ep),
        ] {
            if v == 0 {
                return Err(err(format!("`{name}` must be at least 1, got 0")));
            }
        }
        if self.sp && self.tp < 2 {
            return Err(err("`sp` (sequence parallelism) needs tp > 1".into()));
        }
        Ok(())
    }

    /// `pp·dp·ep·cp·tp`.
    pub fn world_size(&self) -> usize {
        self.dp * self.tp * self.pp * self.cp * self.ep
    }

    /// `Err` unless `world_size()` equals `n`, the number of ranks actually running.
    pub fn check_world_size(&self, n: usize) -> Result<()> {
        if self.world_size() != n {
            return Err(Error::InvalidConfig {
                input: self.to_string(),
                detail: format!(
                    "world size pp·dp·ep·cp·tp = {} but {n} ranks are running",
                    self.world_size()
                ),
            });
        }
        Ok(())
    }

    /// The degree of one axis. A user-declared axis is not a key of the config: 1 (its size is given to
    /// [`Mesh::new`] directly; [`ParallelConfig::mesh`] refuses it).
    pub fn degree(&self, axis: AxisKind) -> usize {
        if !axis.is_builtin() {
            return 1;
        }
        match axis.role() {
            AxisRole::Dp => self.dp,
            AxisRole::Tp => self.tp,
            AxisRole::Pp => self.pp,
            AxisRole::Cp => self.cp,
            AxisRole::Ep => self.ep,
        }
    }

    /// The mesh for a model whose layouts use `axes` (in that layout order), with the
    /// default composition order. Axes the model does not use must have degree 1. Only
    /// built-in axes have a degree here; a mesh with user-declared axes (HSDP's
    /// `dp_replicate`, `dp_shard`) is built with [`Mesh::new`].
    pub fn mesh(&self, axes: &[AxisKind]) -> Result<Mesh> {
        if let Some(a) = axes.iter().find(|a| !a.is_builtin()) {
            return Err(Error::InvalidConfig {
                input: self.to_string(),
                detail: format!(
                    "axis {} (`{a}`) is not one of dp, tp, pp, cp, ep: build its mesh with Mesh::new",
                    a.name()
                ),
            });
        }
        for a in [
            AxisKind::Dp,
            AxisKind::Tp,
            AxisKind::Pp,
            AxisKind::Cp,
            AxisKind::Ep,
        ] {
            if self.degree(a) > 1 && !axes.contains(&a) {
                return Err(Error::InvalidConfig {
                    input: self.to_string(),
                    detail: format!(
                        "{}={} but the model's layouts have no {a} axis",
                        a.name(),
                        self.degree(a)
                    ),
                });
            }
        }
        let sized: Vec<(AxisKind, usize)> = axes.iter().map(|&a| (a, self.degree(a))).collect();
        Mesh::new(&sized)
    }
}

impl FromStr for ParallelConfig {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        ParallelConfig::parse(s)
    }
}

impl fmt::Display for ParallelConfig {
    /// `dp=2,tp=2,sp` (degrees of 1 omitted except dp and tp).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp={},tp={}", self.dp, self.tp)?;
        for (name, v) in [("pp", self.pp), ("cp", self.cp), ("ep", self.ep)] {
            if v != 1 {
                write!(f, ",{name}={v}")?;
            }
        }
        if self.sp {
            f.write_str(",sp")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_the_documented_forms() {
        let c = ParallelConfig::parse("dp=2,tp=2,sp").unwrap();
        assert_eq!((c.dp, c.tp, c.sp, c.world_size()), (2, 2, true, 4));
        let c: ParallelConfig = "tp=4, pp=2, cp=2".parse().unwrap();
        assert_eq!(c.world_size(), 16);
        assert_eq!(
            ParallelConfig::parse("").unwrap(),
            ParallelConfig::default()
        );
        assert_eq!(c.to_string(), "dp=1,tp=4,pp=2,cp=2");
    }

    #[test]
    fn parse_errors_are_one_line_and_name_the_problem() {
        let cases = [
            ("dp=2,sp", "needs tp > 1"),
            ("dp=2,xx=3", "unknown key `xx`"),
            ("tp=0", "at least 1"),
            ("tp=two", "not a positive integer"),
            ("tp", "needs a value"),
            ("tp=2,tp=2", "given twice"),
            ("sp=maybe,tp=2", "true/false"),
        ];
        for (input, want) in cases {
            let e = ParallelConfig::parse(input).unwrap_err().to_string();
            assert!(e.contains(want), "{input}: {e}");
            assert!(!e.contains('\n'), "{input}: {e}");
        }
    }

    #[test]
    fn world_size_and_mesh_are_checked() {
        let c = ParallelConfig::parse("dp=2,tp=2").unwrap();
        assert!(c.check_world_size(4).is_ok());
        assert!(c
            .check_world_size(8)
            .unwrap_err()
            .to_string()
            .contains("8 ranks"));
        let m = c.mesh(&[AxisKind::Dp, AxisKind::Tp]).unwrap();
        assert_eq!(m.to_string(), "[dp=2, tp=2]");
        assert!(c.mesh(&[AxisKind::Tp]).is_err());
        let m = c
            .mesh(&[AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp])
            .unwrap();
        assert_eq!(m.to_string(), "[dp=2, ep=1, cp=1, tp=2]");
        let e = ParallelConfig::parse("ep=2,dp=2").unwrap();
        assert_eq!(e.world_size(), 4);
        assert!(e.mesh(&[AxisKind::Dp, AxisKind::Tp]).is_err());
        crate::mesh_axis!(DpShard, "dp_shard", role = Dp);
        let k = <DpShard as crate::MeshAxis>::KIND;
        assert_eq!(c.degree(k), 1);
        let e = c.mesh(&[k, AxisKind::Tp]).unwrap_err().to_string();
        assert!(e.contains("dp_shard"), "{e}");
    }
}

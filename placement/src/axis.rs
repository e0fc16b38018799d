//! Mesh axes as zero-sized marker types, so a layout names its axes in its type and a
//! method call reads `x.all_gather(Tp)`.

use std::fmt;

/// The parallelism an axis carries, at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AxisKind {
    /// Data parallel (replicas; FSDP/ZeRO shard optimizer state along it).
    Dp,
    /// Pipeline parallel (layers by depth).
    Pp,
    /// Expert parallel (MoE experts, all-to-all routing).
    Ep,
    /// Context parallel (long sequences, ring attention).
    Cp,
    /// Tensor parallel (split matmuls; sequence parallel rides on this axis).
    Tp,
}

impl AxisKind {
    pub const ALL: [AxisKind; 5] = [
        AxisKind::Dp,
        AxisKind::Pp,
        AxisKind::Ep,
        AxisKind::Cp,
        AxisKind::Tp,
    ];

    /// Lower-case name as used in configs (`dp`, `tp`, …).
    pub fn name(self) -> &'static str {
        match self {
            AxisKind::Dp => "dp",
            AxisKind::Pp => "pp",
            AxisKind::Ep => "ep",
            AxisKind::Cp => "cp",
            AxisKind::Tp => "tp",
        }
    }

    /// Parses a lower-case axis name.
    pub fn from_name(s: &str) -> Option<AxisKind> {
        AxisKind::ALL.into_iter().find(|a| a.name() == s)
    }
}

impl fmt::Display for AxisKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AxisKind::Dp => "Dp",
            AxisKind::Pp => "Pp",
            AxisKind::Ep => "Ep",
            AxisKind::Cp => "Cp",
            AxisKind::Tp => "Tp",
        })
    }
}

/// A mesh axis marker type.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a mesh axis",
    label = "expected a mesh axis marker such as `Dp`, `Tp`, `Cp`, `Ep` or `Pp`"
)]
pub trait MeshAxis: Copy + Default + fmt::Debug + Send + Sync + 'static {
    const KIND: AxisKind;
}

macro_rules! axis {
    ($name:ident, $doc:literal) => {
        #[doc = $doc]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        pub struct $name;
        impl MeshAxis for $name {
            const KIND: AxisKind = AxisKind::$name;
        }
    };
}

axis!(Dp, "The data-parallel mesh axis.");
axis!(Pp, "The pipeline-parallel mesh axis.");
axis!(Ep, "The expert-parallel mesh axis.");
axis!(Cp, "The context-parallel mesh axis.");
axis!(Tp, "The tensor-parallel mesh axis.");

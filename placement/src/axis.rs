//! Mesh axes as zero-sized marker types, so a layout names its axes in its type and a
//! method call reads `x.all_gather(Tp)`.
//!
//! Five axes are built in: [`Dp`], [`Pp`], [`Ep`], [`Cp`] and [`Tp`]. A mesh that needs
//! more, or two axes of one kind of parallelism (HSDP's `[dp_replicate, dp_shard, tp]`),
//! declares its own markers with [`mesh_axis!`](crate::mesh_axis!); each carries a *role*,
//! the built-in parallelism it stands for, so code that looks for "the data-parallel
//! axes" finds them ([`Mesh::axes_with_role`](crate::Mesh::axes_with_role)).
//!
//! ```
//! use dtensor_placement::*;
//!
//! mesh_axis!(
//!     /// HSDP's replica axis: whole copies of the sharded model.
//!     pub DpReplicate, "dp_replicate", role = Dp
//! );
//! mesh_axis!(pub DpShard, "dp_shard", role = Dp);
//!
//! type Param = layout![DpReplicate: Replicate, DpShard: Shard<0>];
//! assert_eq!(Param::axes().as_slice(), &[DpReplicate::KIND, DpShard::KIND]);
//! assert_eq!(DpShard::KIND.name(), "dp_shard");
//! assert_eq!(DpShard::KIND.to_string(), "DpShard");
//! assert_eq!(DpShard::KIND.role(), AxisRole::Dp);
//! ```

use std::fmt;

/// The built-in parallelism an axis carries: what a custom axis is *for*.
///
/// The variants mirror the built-in [`AxisKind`]s ([`AxisRole::kind`] maps back), so a
/// `match` on [`AxisKind::role`] stays exhaustive however many axes users declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AxisRole {
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

impl AxisRole {
    /// Every role, in declaration order (`Dp`, `Pp`, `Ep`, `Cp`, `Tp`; not the composition
    /// order, which is [`DEFAULT_ORDER`](crate::DEFAULT_ORDER)).
    pub const ALL: [AxisRole; 5] = [
        AxisRole::Dp,
        AxisRole::Pp,
        AxisRole::Ep,
        AxisRole::Cp,
        AxisRole::Tp,
    ];

    /// The built-in axis of this role (`AxisRole::Dp` -> `AxisKind::Dp`).
    pub const fn kind(self) -> AxisKind {
        const fn def(role: AxisRole, name: &'static str, type_name: &'static str) -> AxisDef {
            AxisDef {
                role,
                name,
                type_name,
            }
        }
        const DP: AxisDef = def(AxisRole::Dp, "dp", "Dp");
        const PP: AxisDef = def(AxisRole::Pp, "pp", "Pp");
        const EP: AxisDef = def(AxisRole::Ep, "ep", "Ep");
        const CP: AxisDef = def(AxisRole::Cp, "cp", "Cp");
        const TP: AxisDef = def(AxisRole::Tp, "tp", "Tp");
        AxisKind(match self {
            AxisRole::Dp => &DP,
            AxisRole::Pp => &PP,
            AxisRole::Ep => &EP,
            AxisRole::Cp => &CP,
            AxisRole::Tp => &TP,
        })
    }

    /// Lower-case name of the role, the built-in axis's name (`dp`, `tp`, …).
    pub const fn name(self) -> &'static str {
        self.kind().name()
    }
}

impl fmt::Display for AxisRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.kind(), f)
    }
}

/// A mesh axis, at run time: one of the five built-in axes (`AxisKind::Dp`, …) or one
/// declared with [`mesh_axis!`](crate::mesh_axis!). A thin handle on the axis's
/// [`AxisDef`] (name, marker type name, role).
///
/// Why a struct with associated constants rather than an enum with a `Custom(..)`
/// variant: size. `AxisKind` sits in errors and plan steps; one pointer (8 bytes) keeps
/// `dtensor_core::Error` as small as it was with the 1-byte enum, where a variant
/// carrying a name, a type name and a role made every `Result` in the distributed layer
/// 8 to 32 bytes larger (and tripped `clippy::result_large_err`). The constants still work
/// in expressions and in patterns (`AxisKind::Dp => …`, the type derives `PartialEq`/`Eq`
/// structurally); what they cannot do is be imported (`use AxisKind::Dp`): write
/// `AxisKind::Dp`. A `match` on an `AxisKind` needs a `_` arm; one that must stay
/// exhaustive over the built-in parallelisms matches on [`AxisKind::role`] instead.
///
/// Identity is by name: a [`Mesh`](crate::Mesh) refuses two axes of one name and looks
/// axes up by name, and a custom axis may not take a built-in's name (checked by
/// [`AxisDef::new`]). `==`, `Hash` and `Ord` compare the definitions by value (not by
/// address, which may differ between crates): role first, then name, so the built-ins
/// order as before (`Dp < Pp < Ep < Cp < Tp`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AxisKind(&'static AxisDef);

/// What an axis is: its name, its marker's type name and its role. Built by
/// [`mesh_axis!`](crate::mesh_axis!) (through [`AxisDef::new`], which checks the name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AxisDef {
    role: AxisRole,
    name: &'static str,
    type_name: &'static str,
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

impl AxisDef {
    /// The axis called `name`, whose marker type is `type_name`, carrying `role`.
    ///
    /// Panics (a compile error where [`mesh_axis!`](crate::mesh_axis!) is used) unless
    /// `name` is non-empty lower-case ASCII letters, digits and `_`, starting with a letter
    /// (it appears in configs and in `-`-separated composition orders), and unless a
    /// built-in name (`dp`, `tp`, …) comes with the built-in's own type name and role: a
    /// name means one axis.
    pub const fn new(name: &'static str, type_name: &'static str, role: AxisRole) -> AxisDef {
        let b = name.as_bytes();
        if b.is_empty() || !b[0].is_ascii_lowercase() {
            panic!("a mesh axis name starts with a lower-case ASCII letter");
        }
        let mut i = 0;
        while i < b.len() {
            let c = b[i];
            if !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_') {
                panic!("a mesh axis name is lower-case ASCII letters, digits and `_`");
            }
            i += 1;
        }
        if type_name.is_empty() {
            panic!("a mesh axis marker needs a type name");
        }
        let mut k = 0;
        while k < AxisKind::ALL.len() {
            let builtin = AxisKind::ALL[k].0;
            if str_eq(name, builtin.name)
                && !(str_eq(type_name, builtin.type_name) && builtin.role as u8 == role as u8)
            {
                panic!(
                    "a custom mesh axis may not take a built-in axis's name (dp, pp, ep, cp, tp)"
                );
            }
            k += 1;
        }
        AxisDef {
            role,
            name,
            type_name,
        }
    }
}

#[allow(non_upper_case_globals)]
impl AxisKind {
    /// Data parallel (replicas; FSDP/ZeRO shard optimizer state along it).
    pub const Dp: AxisKind = AxisRole::Dp.kind();
    /// Pipeline parallel (layers by depth).
    pub const Pp: AxisKind = AxisRole::Pp.kind();
    /// Expert parallel (MoE experts, all-to-all routing).
    pub const Ep: AxisKind = AxisRole::Ep.kind();
    /// Context parallel (long sequences, ring attention).
    pub const Cp: AxisKind = AxisRole::Cp.kind();
    /// Tensor parallel (split matmuls; sequence parallel rides on this axis).
    pub const Tp: AxisKind = AxisRole::Tp.kind();
}

impl AxisKind {
    /// The built-in axes.
    pub const ALL: [AxisKind; 5] = [
        AxisKind::Dp,
        AxisKind::Pp,
        AxisKind::Ep,
        AxisKind::Cp,
        AxisKind::Tp,
    ];

    /// The axis `def` defines: what [`mesh_axis!`](crate::mesh_axis!) expands to, with a
    /// `const` definition (`AxisKind::declare(&DEF)`), for a marker's `KIND`.
    pub const fn declare(def: &'static AxisDef) -> AxisKind {
        AxisKind(def)
    }

    /// Lower-case name as used in configs, mesh displays and receipts (`dp`, `tp`,
    /// `dp_shard`, …).
    pub const fn name(self) -> &'static str {
        self.0.name
    }

    /// The marker's type name (`Dp`, `DpShard`), what `Display` prints.
    pub const fn type_name(self) -> &'static str {
        self.0.type_name
    }

    /// The built-in parallelism the axis carries (a built-in axis is its own role).
    pub const fn role(self) -> AxisRole {
        self.0.role
    }

    /// `true` for the five built-in axes.
    pub fn is_builtin(self) -> bool {
        self == self.role().kind()
    }

    /// Parses the lower-case name of a *built-in* axis (custom axes live in the user's
    /// types, not in a registry this crate could search).
    pub fn from_name(s: &str) -> Option<AxisKind> {
        AxisKind::ALL.into_iter().find(|a| a.name() == s)
    }
}

impl fmt::Display for AxisKind {
    /// The marker's type name: `Dp`, `DpShard`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.type_name())
    }
}

impl fmt::Debug for AxisKind {
    /// As `Display` (`Dp`, `DpShard`), as the enum this was printed, so errors that list
    /// axes stay short.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.type_name())
    }
}

/// A mesh axis marker type: declare one with [`mesh_axis!`](crate::mesh_axis!).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a mesh axis",
    label = "expected a mesh axis marker such as `Dp`, `Tp`, `Cp`, `Ep` or `Pp`, or one declared with `mesh_axis!`"
)]
pub trait MeshAxis: Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// The axis at run time: its name, type name and role, as a mesh stores it.
    const KIND: AxisKind;
    /// The axis's role as a type ([`roles::Dp`], …, [`roles::Cp`], [`roles::Tp`]), so a
    /// rule can depend on what an axis is *for*: attention refuses `Shard<0>` on a
    /// `Cp`-role axis, whose token shards are chunks of every sequence rather than whole
    /// samples (see [`AttentionRule`](crate::AttentionRule)).
    type Role: roles::RoleMarker;
}

/// Type-level [`AxisRole`]s: one zero-sized marker per role, named as the role (so a
/// diagnostic that prints one says `Cp`). [`mesh_axis!`](crate::mesh_axis!) sets
/// [`MeshAxis::Role`] from its `role = ...`.
pub mod roles {
    use super::AxisRole;

    /// A role marker: [`Dp`], [`Pp`], [`Ep`], [`Cp`] or [`Tp`] of this module.
    pub trait RoleMarker: Send + Sync + 'static {
        /// The role this marker stands for, at run time.
        const ROLE: AxisRole;
    }

    macro_rules! role_markers {
        ($($name:ident),*) => {$(
            #[doc = ::core::concat!("The `", ::core::stringify!($name), "` role, as a type.")]
            #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
            pub struct $name;
            impl RoleMarker for $name {
                const ROLE: AxisRole = AxisRole::$name;
            }
        )*};
    }
    role_markers!(Dp, Pp, Ep, Cp, Tp);
}

/// Declares a mesh axis marker: a zero-sized `Copy + Default + Debug + Eq + Hash` struct
/// implementing [`MeshAxis`], usable in [`layout!`](crate::layout!) and in typed calls
/// (`x.all_gather(DpShard)`).
///
/// ```
/// # use dtensor_placement::*;
/// mesh_axis!(
///     /// Docs and attributes go before the visibility.
///     pub DpShard, "dp_shard", role = Dp
/// );
/// let mesh = Mesh::new(&[(DpShard::KIND, 2), (AxisKind::Tp, 2)]).unwrap();
/// assert_eq!(mesh.to_string(), "[dp_shard=2, tp=2]");
/// ```
///
/// Syntax: `mesh_axis!(#[attrs]* VIS TypeName, "axis_name", role = ROLE)` where `ROLE` is
/// one of `Dp`, `Pp`, `Ep`, `Cp`, `Tp` (an [`AxisRole`] variant): the parallelism the axis
/// carries, which also places it in a mesh's default composition order (see
/// [`Mesh::new`](crate::Mesh::new)). The name must be lower-case ASCII letters, digits and
/// `_`, and may not be a built-in's (`dp`, `tp`, …); both are checked at compile time:
///
/// ```compile_fail
/// # use dtensor_placement::*;
/// mesh_axis!(pub MyTp, "tp", role = Tp); // `tp` is the built-in Tp axis
/// ```
///
/// The built-in markers are declared with this macro too (`mesh_axis!(pub Tp, "tp", role =
/// Tp)`, whose kind equals `AxisKind::Tp`).
#[macro_export]
macro_rules! mesh_axis {
    ($(#[$meta:meta])* $vis:vis $name:ident, $axis_name:literal, role = $role:ident $(,)?) => {
        $(#[$meta])*
        #[doc = ""]
        #[doc = ::core::concat!(
            "Mesh axis `", $axis_name, "` (role `", ::core::stringify!($role),
            "`), a marker declared with `mesh_axis!`."
        )]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
        $vis struct $name;

        impl $crate::MeshAxis for $name {
            const KIND: $crate::AxisKind = {
                // A `const`, so `&DEF` is promoted to a `'static` reference.
                const DEF: $crate::AxisDef = $crate::AxisDef::new(
                    $axis_name,
                    ::core::stringify!($name),
                    $crate::AxisRole::$role,
                );
                $crate::AxisKind::declare(&DEF)
            };
            type Role = $crate::axis::roles::$role;
        }

        // Evaluates the kind where the marker is declared, so a bad name fails here rather
        // than at the marker's first use.
        const _: $crate::AxisKind = <$name as $crate::MeshAxis>::KIND;
    };
}

mesh_axis!(
    /// The data-parallel mesh axis.
    pub Dp, "dp", role = Dp
);
mesh_axis!(
    /// The pipeline-parallel mesh axis.
    pub Pp, "pp", role = Pp
);
mesh_axis!(
    /// The expert-parallel mesh axis.
    pub Ep, "ep", role = Ep
);
mesh_axis!(
    /// The context-parallel mesh axis.
    pub Cp, "cp", role = Cp
);
mesh_axis!(
    /// The tensor-parallel mesh axis.
    pub Tp, "tp", role = Tp
);

#[cfg(test)]
mod tests {
    use super::*;

    mesh_axis!(DpShard, "dp_shard", role = Dp);
    mesh_axis!(pub(crate) Ring2, "ring2", role = Cp,);

    #[test]
    fn builtin_markers_have_the_builtin_kinds() {
        assert_eq!(Dp::KIND, AxisKind::Dp);
        assert_eq!(Pp::KIND, AxisKind::Pp);
        assert_eq!(Ep::KIND, AxisKind::Ep);
        assert_eq!(Cp::KIND, AxisKind::Cp);
        assert_eq!(Tp::KIND, AxisKind::Tp);
        for (k, r) in AxisKind::ALL.into_iter().zip(AxisRole::ALL) {
            assert_eq!(k.role(), r);
            assert_eq!(r.kind(), k);
            assert!(k.is_builtin());
            assert_eq!(AxisKind::from_name(k.name()), Some(k));
        }
        assert_eq!(AxisKind::Dp.to_string(), "Dp");
        assert_eq!(format!("{:?}", [AxisKind::Dp, AxisKind::Tp]), "[Dp, Tp]");
        assert_eq!(AxisRole::Tp.to_string(), "Tp");
        assert_eq!(AxisRole::Tp.name(), "tp");
    }

    #[test]
    fn custom_markers_carry_name_type_name_and_role() {
        let k = DpShard::KIND;
        assert_eq!(k.name(), "dp_shard");
        assert_eq!(k.to_string(), "DpShard");
        assert_eq!(format!("{k:?}"), "DpShard");
        assert_eq!(k.role(), AxisRole::Dp);
        assert!(!k.is_builtin());
        assert_eq!(Ring2::KIND.role(), AxisRole::Cp);
        assert_eq!(
            <<Ring2 as MeshAxis>::Role as roles::RoleMarker>::ROLE,
            AxisRole::Cp
        );
        assert_eq!(
            <<DpShard as MeshAxis>::Role as roles::RoleMarker>::ROLE,
            AxisRole::Dp
        );
        assert_eq!(AxisKind::from_name("dp_shard"), None);
        fn marker<T: MeshAxis + Copy + Default + fmt::Debug + Eq + std::hash::Hash>() {}
        marker::<DpShard>();
        assert_eq!(std::mem::size_of::<DpShard>(), 0);
        assert_eq!(
            std::mem::size_of::<AxisKind>(),
            std::mem::size_of::<usize>()
        );
        // By role, then name: the built-ins order as before.
        let mut v = vec![k, AxisKind::Tp, Ring2::KIND, AxisKind::Pp, AxisKind::Dp];
        v.sort();
        assert_eq!(
            v,
            vec![AxisKind::Dp, k, AxisKind::Pp, Ring2::KIND, AxisKind::Tp]
        );
    }

    #[test]
    fn patterns_match_builtins_and_custom_constants() {
        const DP_SHARD: AxisKind = DpShard::KIND;
        let what = |k: AxisKind| match k {
            AxisKind::Dp => "dp",
            AxisKind::Tp => "tp",
            DP_SHARD => "dp_shard",
            _ => "other",
        };
        assert_eq!(what(AxisKind::Dp), "dp");
        assert_eq!(what(Tp::KIND), "tp");
        assert_eq!(what(DpShard::KIND), "dp_shard");
        assert_eq!(what(Ring2::KIND), "other");
    }

    #[test]
    #[should_panic(expected = "built-in axis's name")]
    fn a_custom_axis_may_not_take_a_builtin_name() {
        let _ = AxisDef::new("tp", "MyTp", AxisRole::Tp);
    }

    #[test]
    fn axis_names_are_checked() {
        for bad in ["", "DpShard", "dp-shard", "1dp", "dp shard"] {
            let r = std::panic::catch_unwind(|| AxisDef::new(bad, "X", AxisRole::Dp));
            assert!(r.is_err(), "{bad:?} was accepted");
        }
    }
}

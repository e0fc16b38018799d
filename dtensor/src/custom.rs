//! A user's op on the tape: any number of typed inputs and outputs, local kernels that see
//! where their piece sits in the global tensor.
//!
//! [`custom_op`] records an op whose forward maps this rank's input pieces to its output
//! pieces and whose backward maps the output gradients (and the inputs) to the input
//! gradients. The edges are typed: the inputs are `Var`s (a tuple of one to four), the
//! outputs' layouts are the type parameter (a tuple of one to four layouts) and come back as
//! `Var`s of those layouts; every gradient is typed as its value's dual. The output layouts
//! are the user's claim, checked at run time against the local shapes (as
//! [`DTensor::from_local`] does), and the rule is whatever trait bounds the user's function
//! puts on the layouts.
//!
//! The closures see each input as a [`Piece`]: the local tensor and, per dim, the range of
//! global indices this rank holds. A position-dependent op (a rotation by the global row,
//! a mask by the global column) reads its positions there, so it is right under any
//! sharding, uneven shards included. [`Var::custom`] is the one-input shortcut whose
//! closures see only the local tensor.

use crate::any::AnyDTensor;
use crate::compute::local_range;
use crate::error::{Error, Result};
use crate::tape::{GradStore, Tape, Var};
use crate::typed::DTensor;
use dtensor_kernels::Tensor;
use dtensor_placement::{Layout, Placement};
use smallvec::SmallVec;
use std::ops::Range;
use std::sync::Arc;

/// One input of a custom op as its closures see it: this rank's piece of the global
/// tensor, and where that piece sits.
pub struct Piece<'a> {
    value: &'a AnyDTensor,
    ranges: SmallVec<[Range<usize>; 4]>,
}

impl<'a> Piece<'a> {
    fn of(op: &'static str, value: &'a AnyDTensor) -> Result<Self> {
        let ranges = (0..value.global_shape().len())
            .map(|d| local_range(value, d))
            .collect::<Result<_>>()
            .map_err(|e| Error::ShapeMismatch {
                op,
                detail: format!("cannot place an input's piece: {e}"),
            })?;
        Ok(Piece { value, ranges })
    }

    /// This rank's piece.
    pub fn local(&self) -> &'a Tensor {
        self.value.as_local()
    }

    /// The global tensor's shape.
    pub fn global_shape(&self) -> &'a [usize] {
        self.value.global_shape()
    }

    /// The input's placement on each mesh axis.
    pub fn placements(&self) -> &'a [Placement] {
        self.value.placements()
    }

    /// The global indices of dim `dim` this rank holds: local index `i` is global index
    /// `range(dim).start + i`. A dim no axis shards is whole (`0..n`); along a dim a
    /// `Ragged` axis cuts (an MoE dispatch's rows) the rows are this rank's own and have
    /// no global position, so the range is `0..` its local rows. Panics if `dim` is not a
    /// dim of the input.
    pub fn range(&self, dim: usize) -> Range<usize> {
        self.ranges[dim].clone()
    }

    /// The global offset of this rank's piece along `dim` (`range(dim).start`).
    pub fn offset(&self, dim: usize) -> usize {
        self.ranges[dim].start
    }
}

/// The inputs of a [`custom_op`]: a tuple of one to four `&Var`s on one tape.
pub trait CustomInputs<'t> {
    /// How many inputs.
    const LEN: usize;
    #[doc(hidden)]
    fn parts(&self) -> SmallVec<[(&'t Tape, usize, AnyDTensor); 4]>;
}

/// The output layouts of a [`custom_op`]: a tuple of one to four layouts; the op returns a
/// tuple of `Var`s of them.
pub trait CustomOutputs {
    /// How many outputs.
    const LEN: usize;
    /// The `Var`s the op returns.
    type Vars<'t>;
    #[doc(hidden)]
    fn placements(i: usize) -> SmallVec<[Placement; 4]>;
    #[doc(hidden)]
    fn grad_placements(i: usize) -> SmallVec<[Placement; 4]>;
    #[doc(hidden)]
    fn wrap<'t>(tape: &'t Tape, values: Vec<AnyDTensor>, ids: &[usize]) -> Self::Vars<'t>;
}

macro_rules! tuples {
    ($len:expr; $($T:ident $i:tt),+) => {
        impl<'t, $($T: Layout),+> CustomInputs<'t> for ($(&Var<'t, $T>,)+) {
            const LEN: usize = $len;
            fn parts(&self) -> SmallVec<[(&'t Tape, usize, AnyDTensor); 4]> {
                smallvec::smallvec![$((self.$i.tape(), self.$i.id(), self.$i.value().as_any().clone())),+]
            }
        }

        impl<$($T: Layout),+> CustomOutputs for ($($T,)+) {
            const LEN: usize = $len;
            type Vars<'t> = ($(Var<'t, $T>,)+);
            fn placements(i: usize) -> SmallVec<[Placement; 4]> {
                match i {
                    $($i => $T::placements(),)+
                    _ => unreachable!("output {i} of {}", $len),
                }
            }
            fn grad_placements(i: usize) -> SmallVec<[Placement; 4]> {
                match i {
                    $($i => <$T::Grad as Layout>::placements(),)+
                    _ => unreachable!("output {i} of {}", $len),
                }
            }
            fn wrap<'t>(tape: &'t Tape, values: Vec<AnyDTensor>, ids: &[usize]) -> Self::Vars<'t> {
                let mut values = values.into_iter();
                ($(Var::<'t, $T>::from_parts(
                    DTensor::wrap(values.next().expect("one value per output")),
                    ids[$i],
                    tape,
                ),)+)
            }
        }
    };
}

tuples!(1; A 0);
tuples!(2; A 0, B 1);
tuples!(3; A 0, B 1, C 2);
tuples!(4; A 0, B 1, C 2, D 3);

/// Records a user's op with several inputs and outputs (see the [module docs](self)).
///
/// `forward(inputs)` returns this rank's piece of each output, in order; output `i` is
/// laid out as the `i`-th layout of `Outs` with global shape `global_shapes[i]` (checked
/// against the local shape). `backward(output_grads, inputs)` gets each output's local
/// gradient (zeros where none arrived) and returns each input's local gradient, or `None`
/// for an input it does not differentiate (no contribution); each is checked against its
/// input's local shape and typed as that input's dual. Both closures run on every rank
/// with this rank's pieces, and the backward owns what it reads (`'static`).
///
/// `Err`, naming the op, when the inputs are on different tapes or meshes, when a closure
/// returns the wrong number of tensors, or when a piece's shape disagrees with its layout.
pub fn custom_op<'t, Outs: CustomOutputs>(
    name: &'static str,
    inputs: impl CustomInputs<'t>,
    global_shapes: &[&[usize]],
    forward: impl FnOnce(&[Piece<'_>]) -> Result<Vec<Tensor>>,
    backward: impl FnOnce(&[Tensor], &[Piece<'_>]) -> Result<Vec<Option<Tensor>>> + 'static,
) -> Result<Outs::Vars<'t>> {
    let bad = move |detail: String| Error::ShapeMismatch { op: name, detail };
    let parts = inputs.parts();
    let (tape, mesh) = (parts[0].0, parts[0].2.device_mesh().clone());
    for (i, (t, _, v)) in parts.iter().enumerate().skip(1) {
        if !std::ptr::eq(*t, tape) {
            return Err(bad(format!("input {i} is on another tape than input 0")));
        }
        if !Arc::ptr_eq(v.device_mesh(), &mesh) && v.device_mesh().mesh() != mesh.mesh() {
            return Err(bad(format!(
                "input {i} is on mesh {:?}, input 0 on {:?}",
                v.device_mesh().mesh(),
                mesh.mesh()
            )));
        }
    }
    if global_shapes.len() != Outs::LEN {
        return Err(bad(format!(
            "{} global shapes for {} outputs",
            global_shapes.len(),
            Outs::LEN
        )));
    }
    let ids: SmallVec<[usize; 4]> = parts.iter().map(|p| p.1).collect();
    let values: Vec<AnyDTensor> = parts.into_iter().map(|p| p.2).collect();
    let locals = {
        let pieces = pieces(name, &values)?;
        forward(&pieces)?
    };
    if locals.len() != Outs::LEN {
        return Err(bad(format!(
            "forward returned {} tensors for {} outputs",
            locals.len(),
            Outs::LEN
        )));
    }
    let outputs = locals
        .into_iter()
        .zip(global_shapes)
        .enumerate()
        .map(|(i, (local, global))| {
            AnyDTensor::from_local_for(name, local, global, &Outs::placements(i), &mesh)
        })
        .collect::<Result<Vec<_>>>()?;
    let grad_placements = (0..Outs::LEN).map(Outs::grad_placements).collect();
    let input_ids = ids.clone();
    let out_ids = tape.record_many(
        &outputs,
        grad_placements,
        &ids,
        move |dys, store: &mut GradStore| {
            let dys: Vec<Tensor> = dys.iter().map(|d| d.as_local().clone()).collect();
            let dxs = {
                let pieces = pieces(name, &values)?;
                backward(&dys, &pieces)?
            };
            if dxs.len() != values.len() {
                return Err(bad(format!(
                    "backward returned {} gradients for {} inputs",
                    dxs.len(),
                    values.len()
                )));
            }
            for ((dx, x), &id) in dxs.into_iter().zip(&values).zip(&input_ids) {
                if let Some(dx) = dx {
                    let dual: SmallVec<[Placement; 4]> =
                        x.placements().iter().map(|p| p.dual()).collect();
                    let g = AnyDTensor::from_local_for(
                        name,
                        dx,
                        x.global_shape(),
                        &dual,
                        x.device_mesh(),
                    )?;
                    store.accumulate_any(id, g)?;
                }
            }
            Ok(())
        },
    );
    Ok(Outs::wrap(tape, outputs, &out_ids))
}

fn pieces<'a>(op: &'static str, values: &'a [AnyDTensor]) -> Result<Vec<Piece<'a>>> {
    values.iter().map(|v| Piece::of(op, v)).collect()
}

impl<'t, L: Layout> Var<'t, L> {
    /// A user's op of one input: `forward` computes this rank's output from the local
    /// input, `backward` the local input gradient from the local output gradient. The
    /// output layout `Out` and global shape are the user's claim (as with
    /// `DTensor::from_local`, they are checked against the local shapes); the gradients
    /// are typed as the duals. For several inputs or outputs, or a closure that needs its
    /// piece's global position, see [`custom_op`].
    pub fn custom<Out: Layout>(
        &self,
        name: &'static str,
        global_out: &[usize],
        forward: impl FnOnce(&Tensor) -> Result<Tensor>,
        backward: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor> + 'static,
    ) -> Result<Var<'t, Out>> {
        let (y,) = custom_op::<(Out,)>(
            name,
            (self,),
            &[global_out],
            |x| Ok(vec![forward(x[0].local())?]),
            |dy, x| Ok(vec![Some(backward(&dy[0], x[0].local())?)]),
        )?;
        Ok(y)
    }
}

// Control: context attention over Cp with samples over Dp and heads over Tp, on values
// and on the tape; plain attention with the sequences whole over Cp.
use dtensor::kernels::ops::CausalAttention;
use dtensor::prelude::*;
#[allow(dead_code)]
fn f(
    x: DTensor<layout![Dp: Shard<0>, Cp: Shard<0>, Tp: Shard<1>]>,
    w: DTensor<layout![Dp: Shard<0>, Cp: Replicate, Tp: Shard<1>]>,
    cfg: &ContextAttention,
    plain: &CausalAttention,
) -> Result<()> {
    let _ = x.context_attention(Cp, cfg)?;
    let _ = w.causal_attention(plain)?;
    let tape = Tape::new();
    let _ = tape.leaf(x).context_attention(Cp, cfg)?;
    Ok(())
}
fn main() {}

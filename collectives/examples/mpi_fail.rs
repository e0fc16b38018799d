//! A program whose last rank fails on purpose, for `scripts/mpi-tests.sh`: the whole job
//! must end with a non-zero exit code and a message naming the rank, never hang.
//!
//! ```text
//! mpirun -np 2 target/debug/examples/mpi_fail <error|panic|early|absent>
//! mpirun -np 2 target/debug/examples/mpi_fail async-<error|panic|early|absent>
//! ```
//!
//! | mode | the last rank | the others | expected |
//! |---|---|---|---|
//! | `error` | returns an error | wait in an all-reduce | `rank R failed: returned an error: …`, exit 1 |
//! | `panic` | panics | wait in an all-reduce | `rank R failed: panicked: …`, exit 1 |
//! | `early` | returns `Ok` at once | wait in an all-reduce | peers: `RankFailed` naming it; exit 1 |
//! | `absent` | never arrives (sleeps) | wait in an all-reduce | `Timeout` after `DTENSOR_TIMEOUT_SECS`, exit 1 |
//!
//! With `async-`, the same through asynchronous all-reduces: every rank starts one (`a`)
//! and the last rank fails without waiting for it (its drop waits), while the others start
//! a second (`b`) and wait for both: `a` completes, and `b`'s `wait` returns the error that
//! the blocking call would have (then the rank fails with it, as above).

use dtensor_collectives::{mpi, CommunicatorExt, Error, ReduceOp};
use std::time::Duration;

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_else(|| "error".into());
    let (asynchronous, mode) = match arg.strip_prefix("async-") {
        Some(mode) => (true, mode.to_string()),
        None => (false, arg),
    };
    mpi::run(|comm| {
        let last = comm.rank() + 1 == comm.size();
        let mut v = vec![1.0f32; 8];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        let a = asynchronous.then(|| comm.start_all_reduce_vec(v.clone(), ReduceOp::Sum));
        if last {
            match mode.as_str() {
                "error" => {
                    return Err(Error::InvalidArgument {
                        op: "mpi_fail",
                        detail: "failing on purpose".into(),
                    })
                }
                "panic" => panic!("panicking on purpose"),
                "early" => return Ok(()),
                "absent" => std::thread::sleep(Duration::from_secs(3600)),
                other => panic!("unknown mode {other}"),
            }
        }
        match a {
            Some(a) => {
                let b = comm.start_all_reduce_vec(v, ReduceOp::Sum);
                a.wait()?;
                b.wait()?;
            }
            None => comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?,
        }
        Ok::<_, Error>(())
    });
}

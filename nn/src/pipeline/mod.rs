//! # Pipeline-parallel schedules as data
//!
//! A pipeline schedule decides, for every rank, the order of its forwards, backwards and
//! point-to-point transfers. A wrong order does not fail loudly: it hangs the job (two ranks
//! each blocked in a send to the other) or quietly holds more activations than planned,
//! and both show up on a cluster, far from their cause. So a schedule here is plain data,
//! a [`Schedule`] with one ordered list of [`Action`]s per rank, made by a generator,
//! checked by [`Schedule::validate`] before anything runs, and timed by
//! [`Schedule::simulate`] without hardware. The runtime that executes it ([`Pipeline`]) is a
//! loop over `actions[rank]` with no scheduling logic of its own.
//!
//! The schedules are pure logic (no tensors, no communicators); [`Pipeline`] runs one on
//! ranks with a GPT cut into [`GptStage`]s.
//!
//! ## Layout
//!
//! `pp` ranks each hold `v` model chunks (`virtual_stages_per_rank`; `v = 1` except for the
//! interleaved schedule), so the model is cut into `pp · v` virtual stages. Stage `s` lives
//! on rank `s % pp` as its chunk `s / pp` (Megatron-LM's interleaved layout: rank `r` holds
//! chunks `r, r + pp, r + 2pp, …`). Stage 0 holds the embedding, the last stage the head and
//! the loss. A step runs `m` microbatches through every stage forward, then backward.
//!
//! ## Actions
//!
//! | action | shown as | meaning |
//! |---|---|---|
//! | [`Action::Forward`] | `F(mb 3, stage 5)` | forward; keeps activations for the backward |
//! | [`Action::Backward`] | `BW(mb 3, stage 5)` | full backward (input and weight gradients) |
//! | [`Action::BackwardInput`] | `B(mb 3, stage 5)` | zero-bubble `B`: input gradient only |
//! | [`Action::BackwardWeight`] | `W(mb 3, stage 5)` | zero-bubble `W`: weight gradient only |
//! | [`Action::SendActivation`] / [`Action::RecvActivation`] | `SendAct(mb 3, stage 5 -> rank 2)` | activation to / from the neighbouring stage |
//! | [`Action::SendGradient`] / [`Action::RecvGradient`] | `RecvGrad(mb 3, stage 5 <- rank 2)` | gradient to / from the neighbouring stage |
//!
//! Transfers are explicit because their *order* on each rank decides whether blocking
//! communication deadlocks; a transfer names its local stage and its peer rank.
//!
//! ## Generators
//!
//! | generator | per-rank order | live activations on rank `r` | bubble (idle share) |
//! |---|---|---|---|
//! | [`gpipe`]`(pp, m)` | all `F`, then all `BW` | `m` | `(p − 1)/(m + p − 1)` |
//! | [`one_f_one_b`]`(pp, m)` | `p − r − 1` warm-up `F`, then `F`/`BW` pairs, then cool-down `BW` | `≤ p − r` | `(p − 1)/(m + p − 1)` |
//! | [`interleaved_1f1b`]`(pp, v, m)` | Megatron-LM's interleaved order, `m % pp == 0` for `v ≥ 2` | `≤ 2(p − r − 1) + (v − 1)p + 1` chunks | `(p − 1)/(v·m + p − 1)` |
//! | [`zero_bubble_h1`]`(pp, m)` | 1F1B with `B`/`W` split, `W` delayed by `r`, spare `W`s in the cool-down | `≤ p − r` until `B`, `≤ p` until `W` | `(p − 1)/(3m + p − 1)`, `m ≥ p`, `F = B = W` |
//!
//! Sources: GPipe, Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et al. 2021,
//! "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
//! §2.2; ZB-H1, Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024) §2. The formulas
//! assume equal costs on every stage and free communication; [`Schedule::memory_bound`]
//! and [`Schedule::analytic_bubble`] state each one and its derivation. Bad sizes (`pp`,
//! `v` or `m` zero, or an `m` the interleaved order cannot take) are an
//! [`Error::InvalidSchedule`](dtensor_core::Error::InvalidSchedule), never a panic.
//!
//! ## Why rendezvous is the communication model
//!
//! [`Schedule::validate`] runs all ranks' programs together under *rendezvous* semantics: a
//! send blocks until the peer reaches the matching receive, and a receive until the peer
//! reaches the matching send. That is the strictest semantics a backend may impose, and
//! the one every backend allows:
//!
//! * our backends buffer. `Communicator::send` in `dtensor-collectives` returns at once:
//!   the threads backend queues the message in a mailbox per (source, destination, tag),
//!   the MPI backend copies it and posts an `MPI_Isend`; only `recv` blocks. Every
//!   rendezvous execution is also a buffered one, and since each rank's program is fixed
//!   and messages match by source in order, whether a buffered run completes does not
//!   depend on timing: a schedule that completes under rendezvous completes on them too.
//!   The converse fails, which is the point:
//! * MPI's standard-mode `MPI_Send` may block until the receive is posted (implementations
//!   switch from eager to rendezvous protocol above a message-size threshold, and
//!   `MPI_Ssend` always waits), and NCCL's `ncclSend`/`ncclRecv` complete only as a pair.
//!   "Both neighbours send first" runs on a buffering backend and hangs on those, and in
//!   between it costs buffer memory that no bound here accounts for.
//!
//! So a schedule that passes moves unchanged to a blocking backend. The generators order
//! transfers so that they pass (the receive comes right before the computation that needs
//! it, the send at the same moment, which makes a steady-state "send activation forward,
//! receive gradient back" come out in matching order on both neighbours). A consequence
//! for the runtime: matched pairs advance both ranks together, so each rank's sends to a
//! peer happen in the order that peer receives them, and one message tag with per-pair
//! FIFO order identifies every transfer.
//!
//! Both claims (deadlock-free under rendezvous, and matching in per-pair call order with
//! tags only checked, as on NCCL) are tested on the host, not only by `validate`: the
//! workspace's `tests/rendezvous.rs`
//! (`pipeline_every_schedule_under_rendezvous_matches_threads_bitwise`) runs [`Pipeline`]
//! with GPipe, 1F1B, interleaved 1F1B (`v = 2`) and ZB-H1 at `pp = 2` and `4` (with
//! `tp = 2`) over thread ranks wrapped in `dtensor_collectives::unbuffered::Unbuffered`,
//! which gives `send`/`recv` NCCL's semantics (a send returns once its receiver has taken
//! it; a receive whose tag differs from the pair's next message fails), and checks the
//! losses bitwise against plain threads; the next test there does the same at `pp = 2`,
//! `dp = 2` with DDP buckets and FSDP's prefetch in flight around the hops (the emulator
//! queues a send behind the rank's requests, as NCCL's stream does). The emulator does not
//! model NCCL's reduction order (see its docs).
//!
//! ## Memory accounting
//!
//! [`LiveCount`] counts, per rank, forwards done whose backward is not done:
//! `activations` until the full backward or `B` (what `B` frees: the bulk of a stage's
//! activations), `in_flight` until the full backward or `W` (what `W` still holds: the
//! layers' inputs and output gradients). Without the `B`/`W` split the two are equal.
//! Validation checks both against the kind's bound. ZB-H1 keeps 1F1B's `p − r` for
//! `activations`, while its delayed `W` passes leave `p` microbatches in flight on every
//! rank: the paper's "same peak memory as 1F1B" is the maximum over ranks (rank 0's `p`).
//!
//! ## Example: 1F1B with `pp = 4`, `m = 8`
//!
//! One cell per time unit with [`Costs::uniform`] (a forward takes 1, a full backward 2):
//! `Fk` is the forward of microbatch `k`, `Bk` its backward, dots are the bubble. Rank 0
//! holds at most 4 microbatches, rank 3 one; 3 of every 11 cells idle, `(p − 1)/(m + p −
//! 1)`. ZB-H1 on the same sizes and costs moves `W` into the cool-down and needs 27 units
//! instead of 33.
//!
//! ```
//! use dtensor_nn::pipeline::{one_f_one_b, zero_bubble_h1, Costs};
//!
//! let schedule = one_f_one_b(4, 8)?;
//! // Complete, every send matched, deadlock-free under rendezvous, at most 4 − r live
//! // activations on rank r.
//! schedule.validate()?;
//! let timeline = schedule.simulate(Costs::uniform())?;
//! assert_eq!(
//!     timeline.render(1.0)?,
//!     "\
//! rank 0 |F0F1F2F3............B0B0F4B1B1F5B2B2F6B3B3F7B4B4..B5B5..B6B6..B7B7|
//! rank 1 |..F0F1F2........B0B0F3B1B1F4B2B2F5B3B3F6B4B4F7B5B5..B6B6..B7B7....|
//! rank 2 |....F0F1....B0B0F2B1B1F3B2B2F4B3B3F5B4B4F6B5B5F7B6B6..B7B7........|
//! rank 3 |......F0B0B0F1B1B1F2B2B2F3B3B3F4B4B4F5B5B5F6B6B6F7B7B7............|
//! "
//! );
//! assert_eq!(timeline.bubble_fraction(), 3.0 / 11.0);
//! assert_eq!(schedule.analytic_bubble(), Some(3.0 / 11.0));
//!
//! let zb = zero_bubble_h1(4, 8)?;
//! zb.validate()?;
//! let zb_timeline = zb.simulate(Costs::uniform())?;
//! assert_eq!(
//!     zb_timeline.render(1.0)?,
//!     "\
//! rank 0 |F0F1F2F3......B0W0F4B1W1F5B2W2F6B3W3F7B4W4B5W5B6W6B7W7|
//! rank 1 |..F0F1F2....B0F3B1W0F4B2W1F5B3W2F6B4W3F7B5W4B6W5B7W6W7|
//! rank 2 |....F0F1..B0F2B1F3B2W0F4B3W1F5B4W2F6B5W3F7B6W4B7W5W6W7|
//! rank 3 |......F0B0F1B1F2B2F3B3W0F4B4W1F5B5W2F6B6W3F7B7W4W5W6W7|
//! "
//! );
//! assert_eq!(zb_timeline.makespan, 27.0);
//! # Ok::<(), dtensor_nn::dtensor_core::Error>(())
//! ```
//!
//! Each rank's list also holds its transfers; `println!("{schedule}")` prints them, e.g.
//! rank 1 of `one_f_one_b(2, 3)` starts `RecvAct(mb 0, stage 1 <- rank 0), F(mb 0, stage
//! 1), BW(mb 0, stage 1), RecvAct(mb 1, stage 1 <- rank 0), SendGrad(mb 0, stage 1 -> rank
//! 0), …`.
//!
//! ## Not modelled
//!
//! Per-stage cost differences (the embedding and head make the first and last stages
//! heavier), overlap of transfers with computation (non-blocking or batched send/receive),
//! activation recomputation, and the data-parallel gradient reduction after the last `W`.

mod runtime;
mod schedule;
pub(crate) mod stage;

pub use runtime::{check_pipeline, microbatches, Pipeline, PipelineReport};
pub use schedule::{
    bubble_fraction, for_composition, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1, Action,
    Costs, LiveCount, Schedule, ScheduleKind, Span, Timeline,
};
pub use stage::GptStage;

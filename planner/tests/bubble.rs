//! The planner's pipeline bubble against dtensor-nn's schedule simulator: for every
//! schedule at pp ∈ {2, 4, 8} and m ∈ {pp, 2·pp, 4·pp}, [`dtensor_planner::bubble`] equals the
//! idle share of the simulated timeline of the schedule the generators build.
//!
//! Tolerance 1e-12: both sides are exact rationals of small integers, computed in f64 in a
//! different order (the simulator sums idle spans), so they may differ in the last bits.
//! Costs: `F = B = W` (the zero-bubble paper's assumption) for GPipe, 1F1B and ZB-H1; for
//! the interleaved schedule a chunk's forward as long as its full backward (`F = B + W`),
//! the costs its transfers are ordered for (at `F = B = W` its blocking transfers add waits
//! the formula does not count, see `dtensor_nn::pipeline::interleaved_1f1b`).
//!
//! `cargo test -p dtensor-planner --test bubble -- --nocapture` prints the table.

use dtensor_nn::pipeline::{self, Costs, Schedule};
use dtensor_planner::{bubble, Composition, ScheduleKind};

const V: usize = 2;

/// The generator's own schedule, built without the composition (so that a wrong mapping
/// in `for_composition` would show).
fn generated(kind: ScheduleKind, p: usize, m: usize) -> Schedule {
    match kind {
        ScheduleKind::GPipe => pipeline::gpipe(p, m),
        ScheduleKind::OneFOneB => pipeline::one_f_one_b(p, m),
        ScheduleKind::Interleaved1F1B => pipeline::interleaved_1f1b(p, V, m),
        ScheduleKind::ZeroBubbleH1 => pipeline::zero_bubble_h1(p, m),
    }
    .unwrap()
}

#[test]
fn bubble_planned_equals_the_simulated_for_every_schedule() {
    let kinds = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZeroBubbleH1,
    ];
    println!("| schedule | p | m | planner | simulator |\n|---|---|---|---|---|");
    for kind in kinds {
        for p in [2, 4, 8] {
            for m in [p, 2 * p, 4 * p] {
                let spec = format!("pp={p},m={m},{}", kind.token());
                let c: Composition = spec.parse().unwrap();
                assert_eq!(
                    c.virtual_stages,
                    if kind == ScheduleKind::Interleaved1F1B {
                        V
                    } else {
                        1
                    }
                );
                let planned = bubble(&c).unwrap();
                let costs = match kind {
                    ScheduleKind::Interleaved1F1B => Costs::new(2.0, 1.0, 1.0),
                    _ => Costs::uniform(),
                };
                assert_eq!(
                    pipeline::for_composition(&c).unwrap(),
                    generated(kind, p, m)
                );
                let simulated = generated(kind, p, m)
                    .simulate(costs)
                    .unwrap()
                    .bubble_fraction();
                println!("| {kind} | {p} | {m} | {planned:.4} | {simulated:.4} |");
                assert!(
                    (planned - simulated).abs() < 1e-12,
                    "{spec}: planner {planned}, simulator {simulated}"
                );
            }
        }
    }
}

#[test]
fn bubble_of_zb_h1_is_not_a_third_of_1f1bs_fraction() {
    // The example: p = m = 4. A third of 1F1B's idle time, not of its fraction.
    let zb = zb_composition();
    let one: Composition = "pp=4,m=4,1f1b".parse().unwrap();
    let (zb_bubble, one) = (bubble(&zb).unwrap(), bubble(&one).unwrap());
    assert!((zb_bubble - 3.0 / 15.0).abs() < 1e-12, "{zb_bubble}");
    assert!((one - 3.0 / 7.0).abs() < 1e-12, "{one}");
    // ZB-H1 with fewer microbatches than stages has no formula.
    let short = Composition {
        microbatches: 2,
        ..zb
    };
    assert!(bubble(&short).unwrap_err().contains("no bubble formula"));
}

fn zb_composition() -> Composition {
    "pp=4,m=4,zb".parse().unwrap()
}

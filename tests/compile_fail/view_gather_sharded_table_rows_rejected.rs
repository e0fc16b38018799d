//~ expect: no gather rule for table `Shard<0>` with ids `Replicate` on a mesh axis
use dtensor::prelude::*;
// Ids are global rows: a table split over its rows holds only some of them (the
// vocab-parallel lookup is `embedding`, whose result is Partial).
fn f(table: DTensor<layout![Tp: Shard<0>]>, ids: DTensor<layout![Tp: Replicate]>) {
    let _ = table.gather_rows(&ids);
}
fn main() {}

//! `Options::default()` reads `DTENSOR_TIMEOUT_SECS`. Alone in its own test binary
//! because it changes the process environment.

use dtensor_collectives::threads::{Options, TIMEOUT_ENV};
use std::time::Duration;

#[test]
fn options_default_timeout_from_env_else_120_s() {
    std::env::remove_var(TIMEOUT_ENV);
    assert_eq!(Options::default().timeout, Duration::from_secs(120));
    std::env::set_var(TIMEOUT_ENV, "2.5");
    assert_eq!(Options::default().timeout, Duration::from_millis(2500));
    std::env::set_var(TIMEOUT_ENV, "soon");
    assert_eq!(Options::default().timeout, Duration::from_secs(120));
    std::env::set_var(TIMEOUT_ENV, "-3");
    assert_eq!(Options::default().timeout, Duration::from_secs(120));
    std::env::remove_var(TIMEOUT_ENV);
}

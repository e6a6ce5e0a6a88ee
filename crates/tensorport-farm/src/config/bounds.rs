//! The bounds of every duration and count a configuration holds, in one place. The `check`
//! methods of [`super::ProduceConfig`], [`super::ServeConfig`] and [`super::FarmConfig`]
//! enforce them on a configuration however it was made (flags, a document, a program), before
//! anything starts; a front end's parsers use the same numbers ([`seconds`]), so a value out of
//! range is one clear error, never a panic further in (a deadline past the end of time, a
//! duration of infinite seconds).

use std::fmt::Display;
use std::time::Duration;

use crate::error::ConfigError;

/// The longest duration any setting takes: a week.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The longest a loop spins before it sleeps on a doorbell.
pub const MAX_SPIN: Duration = Duration::from_secs(1);

/// The largest image side a model or a producer takes: 8192 (67 megapixels, past the default
/// limit on an input's pixels).
pub const MAX_IMAGE_SIZE: usize = 8192;

/// Most requests a producer keeps in flight (the transport's most slots per producer).
pub const MAX_IN_FLIGHT: u32 = 256;

/// Most model workers of a server, threads of a model, and CPU threads of a GPU producer.
pub const MAX_THREADS: usize = 1024;

/// Most producers one server takes at once.
pub const MAX_SESSIONS: u32 = 4096;

/// Refuses `value` outside `lo..=hi`, naming `field`.
pub(crate) fn within<T: PartialOrd + Display>(
    field: &'static str,
    value: T,
    lo: T,
    hi: T,
) -> Result<(), ConfigError> {
    if value < lo || value > hi {
        return Err(ConfigError::OutOfRange {
            field,
            value: value.to_string(),
            range: format!("{lo} to {hi}"),
        });
    }
    Ok(())
}

/// Refuses a duration outside `lo..=hi`, naming `field`.
pub(crate) fn duration(
    field: &'static str,
    d: Duration,
    lo: Duration,
    hi: Duration,
) -> Result<(), ConfigError> {
    if d < lo || d > hi {
        return Err(ConfigError::OutOfRange {
            field,
            value: format!("{:?}", d),
            range: format!("{lo:?} to {hi:?}"),
        });
    }
    Ok(())
}

/// A number of seconds as a person writes it (`30`, `0.5`, `1e-3`), from `lo` to
/// [`MAX_DURATION`]; anything else (negative, not finite, not a number, too long) is refused
/// with a sentence saying what to give.
pub fn seconds(s: &str, lo: Duration) -> Result<Duration, String> {
    let hint = || {
        format!(
            "{s:?}: give seconds from {} to {} (a week)",
            lo.as_secs_f64(),
            MAX_DURATION.as_secs()
        )
    };
    let v: f64 = s.trim().parse().map_err(|_| hint())?;
    if !v.is_finite() {
        return Err(hint());
    }
    let d = Duration::try_from_secs_f64(v).map_err(|_| hint())?;
    if d < lo || d > MAX_DURATION {
        return Err(hint());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn seconds_take_what_a_person_writes_and_refuse_the_rest() {
        let ms = Duration::from_millis(1);
        assert_eq!(seconds("30", ms), Ok(Duration::from_secs(30)));
        assert_eq!(seconds("0.5", ms), Ok(Duration::from_millis(500)));
        assert_eq!(seconds("1e-3", ms), Ok(ms));
        assert_eq!(seconds("604800", ms), Ok(MAX_DURATION));
        for bad in [
            "inf",
            "-inf",
            "NaN",
            "1e30",
            "604801",
            "-1",
            "0",
            "",
            "x",
            "18446744073709551615",
        ] {
            let e = seconds(bad, ms).unwrap_err();
            assert!(
                e.contains("give seconds from 0.001 to 604800"),
                "{bad}: {e}"
            );
        }
        assert_eq!(seconds("0", Duration::ZERO), Ok(Duration::ZERO));
    }

    proptest! {
        /// Whatever the text, parsing never panics, and what it takes is in range.
        #[test]
        fn seconds_never_panic_and_stay_in_range(s in "\\PC{0,24}") {
            if let Ok(d) = seconds(&s, Duration::ZERO) {
                prop_assert!(d <= MAX_DURATION);
            }
        }

        #[test]
        fn any_float_is_taken_or_refused_never_panics(v in proptest::num::f64::ANY) {
            if let Ok(d) = seconds(&v.to_string(), Duration::ZERO) {
                prop_assert!(d <= MAX_DURATION);
                prop_assert!(v >= 0.0);
            }
        }

        /// Every duration a check takes can be added to now.
        #[test]
        fn checked_durations_can_be_added_to_now(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
            let d = Duration::new(secs, nanos);
            if duration("t", d, Duration::ZERO, MAX_DURATION).is_ok() {
                prop_assert!(std::time::Instant::now().checked_add(d).is_some());
            }
        }
    }
}

//! Time buckets, resolutions, retention and the planning of window and series reads.
//! Pure arithmetic on milliseconds since the epoch.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

const SECOND: u64 = 1_000;
const MINUTE: u64 = 60 * SECOND;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;

/// Most points a series read may return.
pub const MAX_SERIES_POINTS: u64 = 10_000;

/// Parses `90s`, `15m`, `24h`, `7d` into milliseconds.
pub fn parse_duration(text: &str) -> Result<u64> {
    let invalid = || Error::InvalidDuration(text.to_string());
    let split = text.find(|c: char| !c.is_ascii_digit()).ok_or_else(invalid)?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| invalid())?;
    let unit_ms = match unit {
        "s" => SECOND,
        "m" => MINUTE,
        "h" => HOUR,
        "d" => DAY,
        _ => return Err(invalid()),
    };
    let ms = number.checked_mul(unit_ms).ok_or_else(invalid)?;
    // Bounded so that every later i64 arithmetic on it is safe.
    if ms == 0 || ms > 100_000 * DAY {
        return Err(invalid());
    }
    Ok(ms)
}

/// Formats milliseconds in the largest unit that divides them: `3600000` → `1h`.
pub fn format_duration(ms: u64) -> String {
    for (unit, unit_ms) in [("d", DAY), ("h", HOUR), ("m", MINUTE), ("s", SECOND)] {
        if ms >= unit_ms && ms.is_multiple_of(unit_ms) {
            return format!("{}{unit}", ms / unit_ms);
        }
    }
    format!("{ms}ms")
}

/// The start of the bucket of width `width_ms` that holds `ts`.
pub fn bucket_start(ts: i64, width_ms: i64) -> i64 {
    ts.div_euclid(width_ms) * width_ms
}

/// One bucket width with how long its buckets are kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// `1m`, `1h`… — how it is named in answers and rollups.
    pub name: String,
    pub width_ms: i64,
    pub retention_ms: i64,
}

impl Resolution {
    pub fn new(width: &str, retention: &str) -> Result<Self> {
        let width_ms = parse_duration(width)?;
        let retention_ms = parse_duration(retention)?;
        if retention_ms < width_ms {
            return Err(Error::Config(format!("resolution {width}: retention {retention} is shorter than one bucket")));
        }
        Ok(Self { name: format_duration(width_ms), width_ms: width_ms as i64, retention_ms: retention_ms as i64 })
    }

    /// Whether the bucket starting at `start` is still kept at `now`: it is dropped
    /// once its end is older than the retention.
    pub fn retains(&self, start: i64, now: i64) -> bool {
        start.saturating_add(self.width_ms).saturating_add(self.retention_ms) > now
    }
}

/// The configured resolutions, finest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolutions(Vec<Resolution>);

impl Default for Resolutions {
    /// `1m` kept 6 h, `1h` kept 35 d, `1d` kept 400 d.
    fn default() -> Self {
        let defaults = [("1m", "6h"), ("1h", "35d"), ("1d", "400d")];
        let list = defaults.iter().map(|(w, r)| Resolution::new(w, r)).collect::<Result<Vec<_>>>();
        // The defaults above are valid literals; a failure here is a bug caught by tests.
        Self(list.unwrap_or_default())
    }
}

/// What a read asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowSpec {
    /// The all-time count.
    All,
    /// The sum over the last `window_ms`.
    Last { window_ms: u64 },
    /// A value every `step_ms` over the last `range_ms`.
    Series { step_ms: u64, range_ms: u64 },
}

/// How to answer a [`WindowSpec`] from stored buckets: `points` chunks of `step`
/// ms starting at `start`, each the sum of the `resolution`'s buckets inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `None` for the all-time bucket.
    pub resolution: Option<Resolution>,
    pub start: i64,
    pub step: i64,
    pub points: u64,
    /// The end of the answer (exclusive): the request's `now`.
    pub to: i64,
}

impl Plan {
    /// The name answers carry: the resolution's, or `all`.
    pub fn resolution_name(&self) -> &str {
        self.resolution.as_ref().map_or("all", |r| r.name.as_str())
    }
}

impl Resolutions {
    pub fn new(mut list: Vec<Resolution>) -> Result<Self> {
        if list.is_empty() {
            return Err(Error::Config("at least one resolution is required".into()));
        }
        list.sort_by_key(|r| r.width_ms);
        if list.windows(2).any(|pair| pair[0].width_ms == pair[1].width_ms) {
            return Err(Error::Config("two resolutions have the same width".into()));
        }
        Ok(Self(list))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Resolution> {
        self.0.iter()
    }

    /// The longest time any resolution keeps a bucket: events older than that
    /// count nowhere.
    pub fn longest_retention_ms(&self) -> i64 {
        self.0.iter().map(|r| r.retention_ms).max().unwrap_or(0)
    }

    /// How many there are (never zero).
    pub fn count(&self) -> usize {
        self.0.len()
    }

    pub fn by_width(&self, width_ms: i64) -> Option<&Resolution> {
        self.0.iter().find(|r| r.width_ms == width_ms)
    }

    fn names(&self) -> String {
        self.0.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// Plans a read at time `now`.
    ///
    /// "last X" uses the finest resolution whose retention covers X and sums the
    /// `ceil(X / width)` buckets ending with the current one, so it may miss at most
    /// the older part of one bucket. A series at step S over range R uses the
    /// coarsest resolution that divides S and keeps R, with `ceil(R / S)` points
    /// aligned to multiples of S, the last one holding `now`.
    pub fn plan(&self, spec: WindowSpec, now: i64) -> Result<Plan> {
        match spec {
            WindowSpec::All => Ok(Plan { resolution: None, start: 0, step: 0, points: 1, to: now }),
            WindowSpec::Last { window_ms } => {
                let window = window_ms as i64;
                let resolution = self.0.iter().find(|r| r.retention_ms >= window).ok_or_else(|| {
                    Error::InvalidQuery(format!(
                        "window {} is longer than every retention ({}); use window=all",
                        format_duration(window_ms),
                        self.retentions()
                    ))
                })?;
                let width = resolution.width_ms;
                let buckets = (window + width - 1) / width;
                let start = bucket_start(now, width) - (buckets - 1) * width;
                Ok(Plan { resolution: Some(resolution.clone()), start, step: buckets * width, points: 1, to: now })
            }
            WindowSpec::Series { step_ms, range_ms } => {
                let (step, range) = (step_ms as i64, range_ms as i64);
                let points = range_ms.div_ceil(step_ms);
                if points > MAX_SERIES_POINTS {
                    return Err(Error::InvalidQuery(format!(
                        "range/step is {points} points; at most {MAX_SERIES_POINTS} are allowed"
                    )));
                }
                let dividing: Vec<&Resolution> = self.0.iter().filter(|r| step % r.width_ms == 0).collect();
                if dividing.is_empty() {
                    return Err(Error::InvalidQuery(format!(
                        "step {} is not a multiple of a resolution ({})",
                        format_duration(step_ms),
                        self.names()
                    )));
                }
                let resolution = dividing.iter().rev().find(|r| r.retention_ms >= range).ok_or_else(|| {
                    Error::InvalidQuery(format!(
                        "range {} is longer than the retention of every resolution that divides step {}",
                        format_duration(range_ms),
                        format_duration(step_ms)
                    ))
                })?;
                let start = bucket_start(now, step) - (points as i64 - 1) * step;
                Ok(Plan { resolution: Some((*resolution).clone()), start, step, points, to: now })
            }
        }
    }

    fn retentions(&self) -> String {
        self.0
            .iter()
            .map(|r| format!("{} kept {}", r.name, format_duration(r.retention_ms as u64)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s").unwrap(), 90_000);
        assert_eq!(parse_duration("15m").unwrap(), 900_000);
        assert_eq!(parse_duration("24h").unwrap(), 86_400_000);
        assert_eq!(parse_duration("7d").unwrap(), 604_800_000);
        for bad in ["", "7", "d", "0s", "-1h", "1.5h", "7 d", "7D", "1w", "99999999999999999999d", "200000d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(format_duration(3_600_000), "1h");
        assert_eq!(format_duration(90_000), "90s");
        assert_eq!(format_duration(1_500), "1500ms");
    }

    #[test]
    fn defaults_are_the_spec_defaults() {
        let r = Resolutions::default();
        let listed: Vec<_> = r.iter().map(|r| (r.name.as_str(), r.retention_ms)).collect();
        assert_eq!(listed, vec![("1m", 6 * 3_600_000), ("1h", 35 * 86_400_000), ("1d", 400 * 86_400_000)]);
    }

    #[test]
    fn buckets_floor_towards_minus_infinity() {
        assert_eq!(bucket_start(0, 60_000), 0);
        assert_eq!(bucket_start(59_999, 60_000), 0);
        assert_eq!(bucket_start(60_000, 60_000), 60_000);
        assert_eq!(bucket_start(-1, 60_000), -60_000);
    }

    #[test]
    fn window_picks_finest_covering_resolution() {
        let r = Resolutions::default();
        let now = 10 * 86_400_000 + 123_456;
        let plan = r.plan(WindowSpec::Last { window_ms: parse_duration("15m").unwrap() }, now).unwrap();
        assert_eq!(plan.resolution_name(), "1m");
        assert_eq!(plan.step, 15 * 60_000);
        assert_eq!(plan.start + plan.step, bucket_start(now, 60_000) + 60_000);
        assert_eq!(
            r.plan(WindowSpec::Last { window_ms: parse_duration("6h").unwrap() }, now).unwrap().resolution_name(),
            "1m"
        );
        assert_eq!(
            r.plan(WindowSpec::Last { window_ms: parse_duration("7d").unwrap() }, now).unwrap().resolution_name(),
            "1h"
        );
        assert_eq!(
            r.plan(WindowSpec::Last { window_ms: parse_duration("90d").unwrap() }, now).unwrap().resolution_name(),
            "1d"
        );
        assert!(r.plan(WindowSpec::Last { window_ms: parse_duration("401d").unwrap() }, now).is_err());
        assert_eq!(r.plan(WindowSpec::All, now).unwrap().resolution_name(), "all");
    }

    #[test]
    fn series_picks_coarsest_dividing_resolution() {
        let r = Resolutions::default();
        let now = 10 * 86_400_000 + 5;
        let plan = r.plan(WindowSpec::Series { step_ms: 3_600_000, range_ms: 86_400_000 }, now).unwrap();
        assert_eq!((plan.resolution_name(), plan.points, plan.step), ("1h", 24, 3_600_000));
        assert_eq!(plan.start + 23 * 3_600_000, bucket_start(now, 3_600_000));
        let plan = r.plan(WindowSpec::Series { step_ms: 5 * 60_000, range_ms: 3_600_000 }, now).unwrap();
        assert_eq!((plan.resolution_name(), plan.points), ("1m", 12));
        // 2h steps over 30 days: 1h divides and keeps 35 d.
        let plan = r.plan(WindowSpec::Series { step_ms: 7_200_000, range_ms: 30 * 86_400_000 }, now).unwrap();
        assert_eq!(plan.resolution_name(), "1h");
        assert!(r.plan(WindowSpec::Series { step_ms: 90_000, range_ms: 3_600_000 }, now).is_err());
        assert!(r.plan(WindowSpec::Series { step_ms: 60_000, range_ms: 86_400_000 }, now).is_err());
        assert!(r.plan(WindowSpec::Series { step_ms: 1_000, range_ms: 100 * 86_400_000 }, now).is_err());
    }

    proptest! {
        #[test]
        fn windows_cover_now_and_lose_at_most_one_bucket(window_ms in 1_000u64..400 * 86_400_000, now in 0i64..4_000_000_000_000) {
            let r = Resolutions::default();
            let plan = r.plan(WindowSpec::Last { window_ms }, now).unwrap();
            let res = plan.resolution.clone().unwrap();
            prop_assert!(res.retention_ms >= window_ms as i64);
            prop_assert!(plan.start <= now && now < plan.start + plan.step);
            let covered_back = now - plan.start;
            prop_assert!(covered_back <= window_ms as i64 + res.width_ms);
            prop_assert!(covered_back + res.width_ms > window_ms as i64 - res.width_ms);
            // Every bucket of the window is still retained.
            prop_assert!(res.retains(plan.start, now));
        }

        #[test]
        fn series_points_are_aligned_and_end_at_now(steps in 1u64..10, points in 1u64..36, now in 0i64..4_000_000_000_000) {
            let r = Resolutions::default();
            let step_ms = steps * 60_000;
            let plan = r.plan(WindowSpec::Series { step_ms, range_ms: step_ms * points }, now).unwrap();
            prop_assert_eq!(plan.points, points);
            prop_assert_eq!(plan.start % step_ms as i64, 0);
            let last = plan.start + (points as i64 - 1) * plan.step;
            prop_assert!(last <= now && now < last + plan.step);
            prop_assert_eq!(plan.step % plan.resolution.unwrap().width_ms, 0);
        }

        #[test]
        fn format_then_parse_round_trips(n in 1u64..10_000, unit in 0usize..4) {
            let ms = n * [SECOND, MINUTE, HOUR, DAY][unit];
            prop_assert_eq!(parse_duration(&format_duration(ms)).unwrap(), ms);
        }
    }
}

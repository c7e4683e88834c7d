//! A queue's schedules (`[[queue.schedule]]`) in real time: the next ticks of a
//! cron expression in a time zone, and the job a tick enqueues.

use serde::{Deserialize, Serialize};
use tally_core::jobs::cron::{Civil, Cron};
use tally_core::jobs::{Job, Tick};

/// One schedule of a queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleDecl {
    /// A job id's characters, at most [`MAX_NAME_BYTES`], unique within the
    /// queue: a tick's job id is `<name>-<ms>`.
    pub name: String,
    /// Six fields with seconds: `sec min hour day-of-month month day-of-week`.
    pub cron: String,
    /// An IANA time zone (`Europe/Paris`); UTC by default.
    #[serde(default = "utc", skip_serializing_if = "is_utc")]
    pub time_zone: String,
    /// The payload of every tick's job (any TOML value, handed out as JSON).
    #[serde(default)]
    pub payload: serde_json::Value,
    /// After an outage (ticks more than a minute late): enqueue the latest missed
    /// tick once (`once`, the default), or none (`skip`).
    #[serde(default, skip_serializing_if = "Missed::is_once")]
    pub missed: Missed,
    /// The level of its jobs on a queue with priority levels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Missed {
    #[default]
    Once,
    Skip,
}

impl Missed {
    fn is_once(&self) -> bool {
        *self == Missed::Once
    }
}

fn utc() -> String {
    "UTC".into()
}

fn is_utc(zone: &String) -> bool {
    zone == "UTC"
}

/// The longest schedule name (its ticks' job ids add `-` and up to 20 digits).
pub const MAX_NAME_BYTES: usize = 100;

/// The most schedules a queue may declare.
pub const MAX_SCHEDULES: usize = 100;

/// A schedule ready to tell its ticks.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub decl: ScheduleDecl,
    cron: Cron,
    zone: jiff::tz::TimeZone,
}

impl ScheduleDecl {
    /// The job its tick at `at` enqueues.
    pub fn job(&self, at: i64) -> Job {
        Job {
            id: format!("{}-{at}", self.name),
            payload: serde_json::value::to_raw_value(&self.payload).unwrap_or_else(|_| null()),
            run_at: None,
            key: None,
            priority: self.priority,
            concurrency_key: None,
            unique_key: None,
            unique_for_ms: None,
            tick: Some(Tick { schedule: self.name.clone(), at }),
            trace: None,
        }
    }
}

impl Schedule {
    /// Checks a declaration: the error says what to fix.
    pub fn new(decl: ScheduleDecl) -> Result<Self, String> {
        let name = decl.name.clone();
        tally_core::validate::check_id(&name).map_err(|why| format!("schedule {name:?}: name: {why}"))?;
        if name.len() > MAX_NAME_BYTES {
            // A tick's job id is `<name>-<ms>`, within a job id's bound.
            return Err(format!("schedule {name:?}: name: at most {MAX_NAME_BYTES} bytes"));
        }
        let cron = Cron::parse(&decl.cron).map_err(|why| format!("schedule {name}: {why}"))?;
        let zone = jiff::tz::TimeZone::get(&decl.time_zone).map_err(|_| {
            format!(
                "schedule {name}: time_zone {:?} is not an IANA time zone (e.g. \"Europe/Paris\", \"UTC\")",
                decl.time_zone
            )
        })?;
        let schedule = Self { decl, cron, zone };
        if schedule.next_after(0).is_none() {
            return Err(format!("schedule {name}: cron {:?} never fires", schedule.decl.cron));
        }
        Ok(schedule)
    }

    /// The first tick strictly after `after_ms` (ms since the epoch).
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        let mut civil = self.civil(after_ms)?;
        loop {
            let next = self.cron.next_after(civil)?;
            let at = self.instant(next)?;
            if at > after_ms {
                return Some(at);
            }
            civil = next; // a wall-clock time the clocks went back over
        }
    }

    /// The ticks in `(after_ms, until_ms]`, at most `limit` of them, in order.
    pub fn ticks(&self, after_ms: i64, until_ms: i64, limit: usize) -> Vec<i64> {
        let mut ticks = Vec::new();
        let mut at = after_ms;
        while ticks.len() < limit {
            match self.next_after(at) {
                Some(next) if next <= until_ms => {
                    ticks.push(next);
                    at = next;
                }
                _ => break,
            }
        }
        ticks
    }

    /// A tick as its time zone's wall clock says it (RFC 3339 with the offset).
    pub fn describe(&self, at: i64) -> String {
        match jiff::Timestamp::from_millisecond(at) {
            Ok(instant) => instant.to_zoned(self.zone.clone()).strftime("%Y-%m-%dT%H:%M:%S%:z").to_string(),
            Err(_) => at.to_string(),
        }
    }

    /// The job a tick enqueues.
    pub fn job(&self, at: i64) -> Job {
        self.decl.job(at)
    }

    fn civil(&self, ms: i64) -> Option<Civil> {
        let zoned = jiff::Timestamp::from_millisecond(ms).ok()?.to_zoned(self.zone.clone());
        let dt = zoned.datetime();
        Some(Civil {
            year: i32::from(dt.year()),
            month: dt.month() as u8,
            day: dt.day() as u8,
            hour: dt.hour() as u8,
            minute: dt.minute() as u8,
            second: dt.second() as u8,
        })
    }

    /// The instant of a wall-clock time here: a time the clocks skipped is taken
    /// as the same time after the jump, one they repeat as its first occurrence.
    fn instant(&self, civil: Civil) -> Option<i64> {
        let dt = jiff::civil::DateTime::new(
            i16::try_from(civil.year).ok()?,
            civil.month as i8,
            civil.day as i8,
            civil.hour as i8,
            civil.minute as i8,
            civil.second as i8,
            0,
        )
        .ok()?;
        let zoned = self.zone.to_ambiguous_zoned(dt).compatible().ok()?;
        Some(zoned.timestamp().as_millisecond())
    }
}

fn null() -> Box<serde_json::value::RawValue> {
    serde_json::value::RawValue::from_string("null".into()).expect("null is JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(cron: &str, zone: &str) -> Schedule {
        let decl = ScheduleDecl {
            name: "s".into(),
            cron: cron.into(),
            time_zone: zone.into(),
            payload: serde_json::json!({"a": 1}),
            missed: Missed::Once,
            priority: None,
        };
        Schedule::new(decl).unwrap()
    }

    fn ms(text: &str) -> i64 {
        text.parse::<jiff::Timestamp>().unwrap().as_millisecond()
    }

    #[test]
    fn ticks_follow_the_time_zone_across_its_clock_changes() {
        let paris = schedule("0 30 2 * * *", "Europe/Paris");
        // 2026-03-29: 02:00 jumps to 03:00 in Paris; 02:30 does not exist and runs at 03:30.
        let ticks = paris.ticks(ms("2026-03-27T12:00:00Z"), ms("2026-03-31T00:00:00Z"), 10);
        assert_eq!(ticks, vec![ms("2026-03-28T01:30:00Z"), ms("2026-03-29T01:30:00Z"), ms("2026-03-30T00:30:00Z")]);
        // 2026-10-25: 03:00 goes back to 02:00; 02:30 happens twice and runs once.
        let ticks = paris.ticks(ms("2026-10-24T12:00:00Z"), ms("2026-10-26T12:00:00Z"), 10);
        assert_eq!(ticks, vec![ms("2026-10-25T00:30:00Z"), ms("2026-10-26T01:30:00Z")]);
        let every_second = schedule("* * * * * *", "UTC");
        assert_eq!(every_second.ticks(ms("2026-01-01T00:00:00Z"), ms("2026-01-01T00:00:03Z"), 10).len(), 3);
        assert_eq!(every_second.job(5).tick, Some(Tick { schedule: "s".into(), at: 5 }));
        assert_eq!(every_second.job(5).payload.get(), r#"{"a":1}"#);
    }

    #[test]
    fn bad_schedules_say_what_to_fix() {
        let bad = |cron: &str, zone: &str| {
            let decl = ScheduleDecl {
                name: "s".into(),
                cron: cron.into(),
                time_zone: zone.into(),
                payload: serde_json::Value::Null,
                missed: Missed::Skip,
                priority: None,
            };
            Schedule::new(decl).unwrap_err()
        };
        assert!(bad("* * * *", "UTC").contains("six fields"));
        assert!(bad("* * * * * *", "Mars/Olympus").contains("not an IANA time zone"));
        assert!(bad("0 0 0 31 2 *", "UTC").contains("never fires"));
    }
}

//! Cron expressions with seconds — `sec min hour day-of-month month day-of-week`,
//! each `*`, a number, a range `a-b`, a list `a,b`, or a step `*/n`, `a-b/n` — and
//! the next time one fires after a wall-clock (civil) time. Time zones are the
//! caller's: it turns its clock into civil time and back.
//!
//! As in Vixie cron, when both the day of the month and the day of the week are
//! restricted, a day matching either fires; day of week 0 and 7 are Sunday.

use std::fmt;

/// A wall-clock time, without a time zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Civil {
    pub year: i32,
    pub month: u8,
    pub day: u8,
    pub hour: u8,
    pub minute: u8,
    pub second: u8,
}

impl Civil {
    /// The civil time of `seconds` since the Unix epoch, read as UTC.
    pub fn from_unix(seconds: i64) -> Civil {
        let days = seconds.div_euclid(86_400);
        let rest = seconds.rem_euclid(86_400);
        let (year, month, day) = civil_from_days(days);
        Civil {
            year,
            month,
            day,
            hour: (rest / 3_600) as u8,
            minute: (rest / 60 % 60) as u8,
            second: (rest % 60) as u8,
        }
    }

    /// Seconds since the Unix epoch of this time read as UTC.
    pub fn to_unix(self) -> i64 {
        days_from_civil(self.year, self.month, self.day) * 86_400
            + i64::from(self.hour) * 3_600
            + i64::from(self.minute) * 60
            + i64::from(self.second)
    }
}

impl fmt::Display for Civil {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's).
fn days_from_civil(year: i32, month: u8, day: u8) -> i64 {
    let year = i64::from(year) - i64::from(month <= 2);
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month = i64::from(month);
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + i64::from(day) - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

fn civil_from_days(days: i64) -> (i32, u8, u8) {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let day_of_era = days - era * 146_097;
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * mp + 2) / 5 + 1) as u8;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    ((year_of_era + era * 400 + i64::from(month <= 2)) as i32, month, day)
}

/// A parsed expression: the allowed values of each field as bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cron {
    seconds: u64,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    days_restricted: bool,
    weekdays_restricted: bool,
}

/// How far ahead a next time is looked for.
const HORIZON_DAYS: i64 = 366 * 8;

impl Cron {
    /// Parses six fields; the error names the field at fault.
    pub fn parse(text: &str) -> Result<Cron, String> {
        let fields: Vec<&str> = text.split_whitespace().collect();
        let [seconds, minutes, hours, days, months, weekdays] = fields[..] else {
            return Err(format!(
                "cron {text:?}: six fields are needed — second minute hour day-of-month month day-of-week \
                 (e.g. \"0 */5 * * * *\": every five minutes)"
            ));
        };
        let field = |name: &str, text: &str, low: u32, high: u32| {
            parse_field(text, low, high).map_err(|why| format!("cron {name} {text:?}: {why}"))
        };
        let mut weekday_bits = field("day-of-week", weekdays, 0, 7)?;
        if weekday_bits & (1 << 7) != 0 {
            weekday_bits = (weekday_bits & !(1 << 7)) | 1; // 7 is Sunday too
        }
        Ok(Cron {
            seconds: field("second", seconds, 0, 59)?,
            minutes: field("minute", minutes, 0, 59)?,
            hours: field("hour", hours, 0, 23)?,
            days: field("day-of-month", days, 1, 31)?,
            months: field("month", months, 1, 12)?,
            weekdays: weekday_bits,
            // As Vixie cron: a field that starts with `*` (`*/2` too) restricts nothing.
            days_restricted: !days.starts_with('*'),
            weekdays_restricted: !weekdays.starts_with('*'),
        })
    }

    fn day_matches(&self, days: i64, day: u8) -> bool {
        let weekday = (days + 4).rem_euclid(7) as u32; // 1970-01-01 was a Thursday
        let by_day = self.days & (1 << day) != 0;
        let by_weekday = self.weekdays & (1 << weekday) != 0;
        match (self.days_restricted, self.weekdays_restricted) {
            (true, true) => by_day || by_weekday,
            _ => by_day && by_weekday,
        }
    }

    /// Whether it fires at `at`.
    pub fn fires_at(&self, at: Civil) -> bool {
        let bit = |set: u64, value: u8| set & (1 << value) != 0;
        bit(self.seconds, at.second)
            && bit(self.minutes, at.minute)
            && bit(self.hours, at.hour)
            && bit(self.months, at.month)
            && self.day_matches(days_from_civil(at.year, at.month, at.day), at.day)
    }

    /// The first time strictly after `after` that it fires (none within eight
    /// years: a day that never comes, like February 30).
    pub fn next_after(&self, after: Civil) -> Option<Civil> {
        let start = Civil::from_unix(after.to_unix() + 1);
        let first_day = days_from_civil(start.year, start.month, start.day);
        for days in first_day..first_day + HORIZON_DAYS {
            let (year, month, day) = civil_from_days(days);
            if self.months & (1 << month) == 0 || !self.day_matches(days, day) {
                continue;
            }
            let today = days == first_day;
            for hour in bits_from(self.hours, if today { start.hour } else { 0 }) {
                let this_hour = today && hour == start.hour;
                for minute in bits_from(self.minutes, if this_hour { start.minute } else { 0 }) {
                    let this_minute = this_hour && minute == start.minute;
                    if let Some(second) = bits_from(self.seconds, if this_minute { start.second } else { 0 }).next() {
                        return Some(Civil { year, month, day, hour, minute, second });
                    }
                }
            }
        }
        None
    }
}

/// The values in `set` from `from` up, in order.
fn bits_from(set: u64, from: u8) -> impl Iterator<Item = u8> {
    (from..64).filter(move |value| set & (1 << value) != 0)
}

fn parse_field(text: &str, low: u32, high: u32) -> Result<u64, String> {
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((range, step)) => {
                let step: u32 = step.parse().map_err(|_| format!("step {step:?} is not a number"))?;
                if step == 0 {
                    return Err("a step must be at least 1".into());
                }
                (range, step)
            }
            None => (part, 1),
        };
        let number = |text: &str| -> Result<u32, String> {
            let value: u32 = text.parse().map_err(|_| format!("{text:?} is not a number"))?;
            if !(low..=high).contains(&value) {
                return Err(format!("{value} is outside {low}-{high}"));
            }
            Ok(value)
        };
        let (from, to) = match range {
            "*" => (low, high),
            range => match range.split_once('-') {
                Some((from, to)) => (number(from)?, number(to)?),
                None if step > 1 => (number(range)?, high),
                None => (number(range)?, number(range)?),
            },
        };
        if from > to {
            return Err(format!("the range {from}-{to} is backwards"));
        }
        for value in (from..=to).step_by(step as usize) {
            bits |= 1 << value;
        }
    }
    Ok(bits)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn civil_times_round_trip_and_know_the_calendar() {
        for seconds in [0i64, 951_782_400, 4_107_542_399, -86_400, 1_733_011_200 + 86_399] {
            assert_eq!(Civil::from_unix(seconds).to_unix(), seconds);
        }
        assert_eq!(Civil::from_unix(951_782_400).to_string(), "2000-02-29T00:00:00");
        assert_eq!(Civil::from_unix(0).to_string(), "1970-01-01T00:00:00");
    }

    #[test]
    fn expressions_fire_when_they_say_and_bad_ones_name_the_field() {
        let at = |text: &str| {
            let t = Civil::from_unix(1_764_547_200); // 2025-12-01T00:00:00, a Monday
            Cron::parse(text).unwrap().next_after(t).unwrap().to_string()
        };
        assert_eq!(at("* * * * * *"), "2025-12-01T00:00:01");
        assert_eq!(at("*/15 * * * * *"), "2025-12-01T00:00:15");
        assert_eq!(at("0 30 9 * * 1-5"), "2025-12-01T09:30:00");
        assert_eq!(at("0 0 0 * * 0"), "2025-12-07T00:00:00", "the next Sunday");
        assert_eq!(at("0 0 0 * * 7"), "2025-12-07T00:00:00", "7 is Sunday too");
        assert_eq!(at("0 0 12 29 2 *"), "2028-02-29T12:00:00");
        assert_eq!(at("0 0 0 15 * 3"), "2025-12-03T00:00:00", "day of month or of week");
        assert_eq!(Cron::parse("0 0 0 30 2 *").unwrap().next_after(Civil::from_unix(0)), None);
        assert!(Cron::parse("* * * * *").unwrap_err().contains("six fields"));
        assert!(Cron::parse("61 * * * * *").unwrap_err().starts_with("cron second \"61\": 61 is outside 0-59"));
        assert!(Cron::parse("* * * * 13 *").unwrap_err().contains("cron month"));
        assert!(Cron::parse("*/0 * * * * *").unwrap_err().contains("step"));
        assert!(Cron::parse("* 5-2 * * * *").unwrap_err().contains("backwards"));
    }

    fn field(low: u32, high: u32) -> impl Strategy<Value = String> {
        prop_oneof![
            Just("*".to_string()),
            (low..=high).prop_map(|v| v.to_string()),
            (low..=high, low..=high).prop_map(|(a, b)| format!("{}-{}", a.min(b), a.max(b))),
            (1..10u32).prop_map(|step| format!("*/{step}")),
            proptest::collection::vec(low..=high, 1..4)
                .prop_map(|values| { values.iter().map(u32::to_string).collect::<Vec<_>>().join(",") }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Against a second-by-second scan of the next two days: the next time is
        /// the first one that fires, and none fires before it.
        #[test]
        fn the_next_time_is_the_first_that_fires(
            seconds in field(0, 59), minutes in field(0, 59), hours in field(0, 23),
            days in field(1, 31), weekdays in field(0, 7),
            start in 0i64..4_000_000_000,
        ) {
            let text = format!("{seconds} {minutes} {hours} {days} * {weekdays}");
            let cron = Cron::parse(&text).unwrap();
            let after = Civil::from_unix(start);
            let scanned = (start + 1..start + 2 * 86_400).map(Civil::from_unix).find(|t| cron.fires_at(*t));
            let next = cron.next_after(after);
            match scanned {
                Some(first) => prop_assert_eq!(next, Some(first), "{}", text),
                None => prop_assert!(next.is_none_or(|next| next.to_unix() >= start + 2 * 86_400), "{}", text),
            }
        }
    }
}

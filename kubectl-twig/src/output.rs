//! What the commands print: `-o name|json|yaml`, tables, ages and sizes as kubectl shows them.

use std::io::Write;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::Serialize;

use crate::cli::Output;
use crate::error::Error;

/// Prints `obj` in `format`: `name_line` for `-o name`, `human` without `-o`.
pub fn emit<T: Serialize>(
    format: Option<Output>,
    name_line: &str,
    obj: &T,
    human: &str,
) -> Result<(), Error> {
    let text = match format {
        None => format!("{human}\n"),
        Some(Output::Name) => format!("{name_line}\n"),
        Some(Output::Json) => {
            let mut json =
                serde_json::to_string_pretty(obj).map_err(|e| Error::Output(e.to_string()))?;
            json.push('\n');
            json
        }
        Some(Output::Yaml) => {
            serde_saphyr::to_string(obj).map_err(|e| Error::Output(e.to_string()))?
        }
    };
    print(&text)
}

/// Writes `text` to stdout (a closed pipe is an error, not a panic).
pub fn print(text: &str) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Error::Output(e.to_string()))
}

/// Rows as kubectl aligns them: columns padded to their widest cell, three spaces apart.
pub fn table(rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = Vec::new();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            let width = cell.chars().count();
            match widths.get_mut(i) {
                Some(w) => *w = (*w).max(width),
                None => widths.push(width),
            }
        }
    }
    let mut text = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            line.push_str(cell);
            if i + 1 < row.len() {
                let pad = widths[i] - cell.chars().count() + 3;
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        text.push_str(line.trim_end());
        text.push('\n');
    }
    text
}

/// The age of something created at `time`, as kubectl prints it (`45s`, `3m20s`, `5h`, `2d3h`).
pub fn age(time: Option<&Time>) -> String {
    match time {
        Some(time) => {
            let now = k8s_openapi::jiff::Timestamp::now().as_second();
            human_duration(now - time.0.as_second())
        }
        None => "<unknown>".into(),
    }
}

/// apimachinery's `duration.HumanDuration`, for whole seconds.
pub fn human_duration(seconds: i64) -> String {
    if seconds < -1 {
        return "<invalid>".into();
    }
    let seconds = seconds.max(0);
    if seconds < 120 {
        return format!("{seconds}s");
    }
    let minutes = seconds / 60;
    if minutes < 10 {
        return with_rest(minutes, "m", seconds % 60, "s");
    }
    if minutes < 180 {
        return format!("{minutes}m");
    }
    let hours = seconds / 3600;
    if hours < 8 {
        return with_rest(hours, "h", minutes % 60, "m");
    }
    if hours < 48 {
        return format!("{hours}h");
    }
    if hours < 24 * 8 {
        return with_rest(hours / 24, "d", hours % 24, "h");
    }
    if hours < 24 * 365 * 2 {
        return format!("{}d", hours / 24);
    }
    if hours < 24 * 365 * 8 {
        return with_rest(hours / 24 / 365, "y", (hours / 24) % 365, "d");
    }
    format!("{}y", hours / 24 / 365)
}

fn with_rest(major: i64, major_unit: &str, minor: i64, minor_unit: &str) -> String {
    if minor == 0 {
        format!("{major}{major_unit}")
    } else {
        format!("{major}{major_unit}{minor}{minor_unit}")
    }
}

/// A byte count in binary units, as Kubernetes quantities write them (`512`, `1.5Ki`, `300Mi`).
pub fn size(bytes: Option<u64>) -> String {
    let Some(bytes) = bytes else {
        return "-".into();
    };
    const UNITS: [&str; 6] = ["", "Ki", "Mi", "Gi", "Ti", "Pi"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}")
    } else if value < 10.0 {
        let text = format!("{value:.1}");
        format!("{}{}", text.trim_end_matches(".0"), UNITS[unit])
    } else {
        format!("{}{}", value.round(), UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_like_kubectl() {
        for (seconds, text) in [
            (0, "0s"),
            (119, "119s"),
            (200, "3m20s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (5 * 3600, "5h"),
            (30 * 3600, "30h"),
            (51 * 3600, "2d3h"),
            (400 * 86400, "400d"),
            (3 * 365 * 86400, "3y"),
        ] {
            assert_eq!(human_duration(seconds), text, "{seconds}s");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(size(None), "-");
        assert_eq!(size(Some(512)), "512");
        assert_eq!(size(Some(1536)), "1.5Ki");
        assert_eq!(size(Some(4 << 20)), "4Mi");
        assert_eq!(size(Some(300 << 20)), "300Mi");
    }

    #[test]
    fn aligned_table() {
        let rows = vec![
            vec!["NAME".to_string(), "PHASE".to_string()],
            vec!["a-long-name".to_string(), "Ready".to_string()],
        ];
        assert_eq!(table(&rows), "NAME          PHASE\na-long-name   Ready\n");
    }
}

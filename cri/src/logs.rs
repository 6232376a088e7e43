//! Container logs as CRI writes them (`<time> <stream> <P|F> <text>` per
//! line, under the pod's log directory), and waiting for a container's
//! output by polling its log file.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How often [`wait_for`] re-reads the log file.
pub const POLL: Duration = Duration::from_millis(1);

/// One line a container printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// `stdout` or `stderr`.
    pub stream: String,
    /// The line without its newline; partial (`P`) records joined.
    pub text: String,
}

/// The awaited output did not appear.
#[derive(Debug, thiserror::Error)]
#[error("{path}: no matching output within {after:?}; the log holds {seen:?}")]
pub struct LogTimeout {
    /// The log file.
    pub path: PathBuf,
    /// The deadline that passed.
    pub after: Duration,
    /// The lines present at the deadline.
    pub seen: Vec<LogLine>,
}

/// Parses a CRI log; lines that are not CRI records are skipped, and a
/// trailing line without newline (still being written) is left out.
pub fn parse(content: &str) -> Vec<LogLine> {
    let mut lines = Vec::new();
    let mut partial: Option<LogLine> = None;
    let complete = content.rfind('\n').map_or("", |end| &content[..end]);
    for record in complete.split('\n') {
        let mut fields = record.splitn(4, ' ');
        let (Some(_time), Some(stream), Some(tag)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let text = fields.next().unwrap_or("");
        let mut line = partial.take().unwrap_or_else(|| LogLine {
            stream: stream.into(),
            text: String::new(),
        });
        line.text.push_str(text);
        match tag {
            "P" => partial = Some(line),
            "F" => lines.push(line),
            _ => {}
        }
    }
    lines
}

/// The log's lines so far (none while the file does not exist yet).
pub fn read(path: &Path) -> Vec<LogLine> {
    std::fs::read_to_string(path)
        .map(|s| parse(&s))
        .unwrap_or_default()
}

/// Polls `path` until `done` holds for its lines; returns them.
pub async fn wait_for(
    path: &Path,
    within: Duration,
    mut done: impl FnMut(&[LogLine]) -> bool,
) -> Result<Vec<LogLine>, LogTimeout> {
    let deadline = Instant::now() + within;
    loop {
        let lines = read(path);
        if done(&lines) {
            return Ok(lines);
        }
        if Instant::now() > deadline {
            return Err(LogTimeout {
                path: path.to_path_buf(),
                after: within,
                seen: lines,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_partial_and_unfinished_records() {
        let log = "2024-01-01T00:00:00.1Z stdout F hello\n\
                   2024-01-01T00:00:00.2Z stderr P par\n\
                   2024-01-01T00:00:00.3Z stderr F tial\n\
                   garbage\n\
                   2024-01-01T00:00:00.4Z stdout F \n\
                   2024-01-01T00:00:00.5Z stdout F unfinished";
        let line = |stream: &str, text: &str| LogLine {
            stream: stream.into(),
            text: text.into(),
        };
        assert_eq!(
            parse(log),
            vec![
                line("stdout", "hello"),
                line("stderr", "partial"),
                line("stdout", "")
            ]
        );
        assert!(parse("").is_empty());
    }
}

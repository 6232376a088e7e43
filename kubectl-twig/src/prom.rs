//! A parser of the Prometheus text exposition format (0.0.4) and of
//! OpenMetrics text (1.0), the two formats a `/metrics` endpoint answers
//! with — enough to read samples: metric name, labels, value.
//!
//! - Lines starting with `#` (`# HELP`, `# TYPE`, `# UNIT`, `# EOF`, any
//!   other comment) and blank lines are skipped.
//! - A sample is `name[{label="value",…}] value [timestamp] [# exemplar]`;
//!   label values unescape `\\`, `\"` and `\n`; a trailing comma in the
//!   label set and spaces around labels are accepted; the timestamp and an
//!   OpenMetrics exemplar are read past and dropped.
//! - Values are floats as Prometheus writes them, `NaN`, `+Inf` and `-Inf`
//!   included.
//! - A line that is none of these refuses the whole text, with its line
//!   number: Prometheus fails a scrape on a bad line rather than keep the
//!   rest, and an answer that is not an exposition (an HTML error page from
//!   a proxy, say) must not pass for one with no series.

use std::collections::BTreeMap;

/// One sample of the exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric name of the sample (`…_total` for a counter).
    pub name: String,
    /// Its labels, unescaped.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value as a count (a finite, whole, non-negative number), if it is one.
    pub fn count(&self) -> Option<u64> {
        let value = self.value;
        // 2^64 as f64: larger values do not fit.
        (value.is_finite()
            && value >= 0.0
            && value.fract() == 0.0
            && value < 18_446_744_073_709_551_616.0)
            .then_some(value as u64)
    }
}

/// A line of the text that is not a sample, a comment or blank.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub message: String,
}

/// Every sample of `text`, in order.
pub fn parse(text: &str) -> Result<Vec<Sample>, ParseError> {
    let mut samples = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let sample = parse_sample(line).map_err(|message| ParseError {
            line: index + 1,
            message,
        })?;
        samples.push(sample);
    }
    Ok(samples)
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let mut rest = Cursor(line);
    let name = rest
        .name()
        .ok_or_else(|| format!("no metric name in {line:?}"))?;
    let mut labels = BTreeMap::new();
    rest.skip_spaces();
    if rest.eat('{') {
        loop {
            rest.skip_spaces();
            if rest.eat('}') {
                break;
            }
            let label = rest
                .name()
                .ok_or_else(|| format!("no label name in {line:?}"))?;
            rest.skip_spaces();
            if !rest.eat('=') {
                return Err(format!("label {label} has no '=' in {line:?}"));
            }
            rest.skip_spaces();
            let value = rest
                .quoted()
                .ok_or_else(|| format!("label {label} has no quoted value in {line:?}"))?;
            if labels.insert(label.to_string(), value).is_some() {
                return Err(format!("label {label} given twice in {line:?}"));
            }
            rest.skip_spaces();
            if !rest.eat(',') && !rest.0.starts_with('}') {
                return Err(format!("labels not separated by ',' in {line:?}"));
            }
        }
    }
    // The value, then an optional timestamp and an optional exemplar (`# {…} v [t]`).
    let mut fields = rest.0.split_whitespace();
    let value_text = fields
        .next()
        .ok_or_else(|| format!("no value in {line:?}"))?;
    let value = parse_value(value_text).ok_or_else(|| format!("bad value {value_text:?}"))?;
    match fields.next() {
        None => {}
        Some(exemplar) if exemplar.starts_with('#') => {}
        Some(timestamp) => {
            timestamp
                .parse::<f64>()
                .map_err(|_| format!("bad timestamp {timestamp:?}"))?;
            match fields.next() {
                None => {}
                Some(exemplar) if exemplar.starts_with('#') => {}
                Some(extra) => return Err(format!("unexpected {extra:?} after the timestamp")),
            }
        }
    }
    Ok(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

/// A float as Prometheus writes them: digits, `NaN`, `+Inf`, `-Inf`.
fn parse_value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        // Rust also reads "inf", "infinity", "nan" in any case: not Prometheus' spellings.
        _ if text
            .bytes()
            .any(|b| b.is_ascii_alphabetic() && b != b'e' && b != b'E') =>
        {
            None
        }
        _ => text.parse().ok(),
    }
}

/// The unread rest of a line.
struct Cursor<'a>(&'a str);

impl<'a> Cursor<'a> {
    fn eat(&mut self, c: char) -> bool {
        match self.0.strip_prefix(c) {
            Some(rest) => {
                self.0 = rest;
                true
            }
            None => false,
        }
    }

    fn skip_spaces(&mut self) {
        self.0 = self.0.trim_start_matches([' ', '\t']);
    }

    /// A metric or label name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    fn name(&mut self) -> Option<&'a str> {
        let end = self
            .0
            .char_indices()
            .find(|&(i, c)| {
                !(c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit()))
            })
            .map_or(self.0.len(), |(i, _)| i);
        (end > 0).then(|| {
            let (name, rest) = self.0.split_at(end);
            self.0 = rest;
            name
        })
    }

    /// A double-quoted label value, unescaped (`\\`, `\"`, `\n`).
    fn quoted(&mut self) -> Option<String> {
        let mut chars = self.0.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    self.0 = &self.0[i + 2..];
                    return Some(value);
                }
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    '\\' => value.push('\\'),
                    '"' => value.push('"'),
                    // The text format keeps an unknown escape as it is.
                    other => {
                        value.push('\\');
                        value.push(other);
                    }
                },
                c => value.push(c),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn reads_openmetrics_with_comments() {
        let text = "# HELP twig_pod_network_packets Frames.\n\
                    # TYPE twig_pod_network_packets counter\n\
                    twig_pod_network_packets_total{namespace=\"a\",pod=\"p\",verdict=\"pass\",reason=\"allowed\"} 12\n\
                    \n\
                    up 1\n\
                    # EOF\n";
        let samples = parse(text).expect("parse");
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].name, "twig_pod_network_packets_total");
        assert_eq!(
            samples[0].labels,
            labels(&[
                ("namespace", "a"),
                ("pod", "p"),
                ("verdict", "pass"),
                ("reason", "allowed")
            ])
        );
        assert_eq!(samples[0].count(), Some(12));
        assert_eq!(samples[1].name, "up");
        assert!(samples[1].labels.is_empty());
    }

    #[test]
    fn unescapes_label_values() {
        let text = r#"m{a="x\"y",b="c:\\d",c="l1\nl2",d="{}, =#"} 1"#;
        let sample = &parse(text).expect("parse")[0];
        assert_eq!(
            sample.labels,
            labels(&[
                ("a", "x\"y"),
                ("b", "c:\\d"),
                ("c", "l1\nl2"),
                ("d", "{}, =#")
            ])
        );
    }

    #[test]
    fn reads_special_values_timestamps_and_exemplars() {
        let text = "a NaN\nb +Inf\nc -Inf\nd 1.5e3 1700000000000\n\
                    e_total{x=\"1\",} 7 # {trace_id=\"abc\"} 1 1700000000.1\n\
                    f { x = \"1\" , y=\"2\" } 3\n";
        let samples = parse(text).expect("parse");
        assert!(samples[0].value.is_nan());
        assert_eq!(samples[0].count(), None);
        assert_eq!(samples[1].value, f64::INFINITY);
        assert_eq!(samples[1].count(), None);
        assert_eq!(samples[2].value, f64::NEG_INFINITY);
        assert_eq!(samples[3].value, 1500.0);
        assert_eq!(samples[3].count(), Some(1500));
        assert_eq!(samples[4].labels, labels(&[("x", "1")]));
        assert_eq!(samples[4].count(), Some(7));
        assert_eq!(samples[5].labels, labels(&[("x", "1"), ("y", "2")]));
        assert_eq!(
            Sample {
                name: "g".into(),
                labels: BTreeMap::new(),
                value: 0.5
            }
            .count(),
            None
        );
    }

    #[test]
    fn refuses_bad_lines_with_their_number() {
        for (text, line) in [
            ("ok 1\n<html>\n", 2),
            ("m{a=\"1\" 2\n", 1),
            ("m{a=1} 2\n", 1),
            ("m{a=\"unterminated} 2\n", 1),
            ("m{a=\"1\"b=\"2\"} 3\n", 1),
            ("m{a=\"1\",a=\"2\"} 3\n", 1),
            ("# c\nm\n", 2),
            ("m one\n", 1),
            ("m inf\n", 1),
            ("m 1 soon\n", 1),
            ("m 1 2 3\n", 1),
            ("9m 1\n", 1),
        ] {
            let error = parse(text).expect_err(text);
            assert_eq!(error.line, line, "{text:?}: {error}");
        }
    }
}

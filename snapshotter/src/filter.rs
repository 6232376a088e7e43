//! containerd's filter syntax for `List`/`Walk`, on snapshot fields: `name`,
//! `parent`, `kind` and `labels.<key>` (quote keys with dots:
//! `labels."containerd.io/gc.root"`). A filter is a comma-separated list of
//! selectors that must all match; a selector is a field alone (present and
//! non-empty) or `field==value` / `field!=value`. Several filters are OR-ed.
//! Regular-expression selectors (`~=`) are rejected as unsupported.

use crate::error::{Error, Result};
use crate::store::Info;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

/// One parsed filter: all selectors must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    selectors: Vec<Selector>,
}

impl Filter {
    /// Parses one filter string.
    pub fn parse(input: &str) -> Result<Filter> {
        let bad = |why: &str| Error::InvalidArgument(format!("filter {input:?}: {why}"));
        let chars: Vec<char> = input.chars().collect();
        let mut i = 0;
        let mut selectors = Vec::new();
        loop {
            let mut path = Vec::new();
            loop {
                skip_ws(&chars, &mut i);
                let field = if chars.get(i) == Some(&'"') {
                    quoted(&chars, &mut i).ok_or_else(|| bad("unterminated quote"))?
                } else {
                    let start = i;
                    while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                        i += 1;
                    }
                    if start == i {
                        return Err(bad("expected a field name"));
                    }
                    chars[start..i].iter().collect()
                };
                path.push(field);
                if chars.get(i) == Some(&'.') {
                    i += 1;
                } else {
                    break;
                }
            }
            skip_ws(&chars, &mut i);
            let op = match (chars.get(i), chars.get(i + 1)) {
                (Some('='), Some('=')) | (Some('!'), Some('=')) => {
                    let negate = chars[i] == '!';
                    i += 2;
                    skip_ws(&chars, &mut i);
                    let value = if chars.get(i) == Some(&'"') {
                        quoted(&chars, &mut i).ok_or_else(|| bad("unterminated quote"))?
                    } else {
                        let start = i;
                        while i < chars.len() && chars[i] != ',' {
                            i += 1;
                        }
                        chars[start..i]
                            .iter()
                            .collect::<String>()
                            .trim()
                            .to_string()
                    };
                    if negate {
                        Op::NotEqual(value)
                    } else {
                        Op::Equal(value)
                    }
                }
                (Some('~'), Some('=')) => {
                    return Err(bad("regular-expression selectors (~=) are not supported"))
                }
                _ => Op::Present,
            };
            selectors.push(Selector { path, op });
            skip_ws(&chars, &mut i);
            match chars.get(i) {
                None => break,
                Some(',') => i += 1,
                Some(c) => return Err(bad(&format!("unexpected {c:?}"))),
            }
        }
        Ok(Filter { selectors })
    }

    /// Whether `info` satisfies every selector.
    pub fn matches(&self, info: &Info) -> bool {
        self.selectors.iter().all(|s| {
            let value = field(info, &s.path);
            match &s.op {
                Op::Present => value.is_some_and(|v| !v.is_empty()),
                Op::Equal(want) => value.as_deref() == Some(want.as_str()),
                Op::NotEqual(want) => value.as_deref() != Some(want.as_str()),
            }
        })
    }
}

fn skip_ws(chars: &[char], i: &mut usize) {
    while *i < chars.len() && chars[*i].is_whitespace() {
        *i += 1;
    }
}

/// Reads a double-quoted string with backslash escapes at `chars[*i]`.
fn quoted(chars: &[char], i: &mut usize) -> Option<String> {
    let mut out = String::new();
    *i += 1;
    while let Some(&c) = chars.get(*i) {
        *i += 1;
        match c {
            '"' => return Some(out),
            '\\' => {
                out.push(*chars.get(*i)?);
                *i += 1;
            }
            c => out.push(c),
        }
    }
    None
}

fn field(info: &Info, path: &[String]) -> Option<String> {
    match path.first().map(String::as_str)? {
        "name" if path.len() == 1 => Some(info.name.clone()),
        "parent" if path.len() == 1 => Some(info.parent.clone().unwrap_or_default()),
        "kind" if path.len() == 1 => Some(info.kind.as_str().to_string()),
        "labels" if path.len() > 1 => info.labels.get(&path[1..].join(".")).cloned(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Kind;
    use std::collections::BTreeMap;
    use std::time::SystemTime;

    fn info(name: &str, kind: Kind, labels: &[(&str, &str)]) -> Info {
        Info {
            name: name.into(),
            parent: None,
            kind,
            created: SystemTime::UNIX_EPOCH,
            updated: SystemTime::UNIX_EPOCH,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn selectors_combine_with_and() {
        let f = Filter::parse(r#"kind==committed,labels."containerd.io/gc.root""#).unwrap();
        assert!(f.matches(&info(
            "a",
            Kind::Committed,
            &[("containerd.io/gc.root", "x")]
        )));
        assert!(!f.matches(&info("a", Kind::Active, &[("containerd.io/gc.root", "x")])));
        assert!(!f.matches(&info("a", Kind::Committed, &[])));
    }

    #[test]
    fn equality_and_negation() {
        let f = Filter::parse("name==foo").unwrap();
        assert!(f.matches(&info("foo", Kind::View, &[])));
        assert!(!f.matches(&info("bar", Kind::View, &[])));
        let f = Filter::parse(r#"labels.team != "a b""#).unwrap();
        assert!(f.matches(&info("x", Kind::View, &[("team", "c")])));
        assert!(!f.matches(&info("x", Kind::View, &[("team", "a b")])));
    }

    #[test]
    fn malformed_filters_are_invalid_arguments() {
        for bad in ["", "name==\"x", "name~=x.*", "==x", "name==x,"] {
            assert!(
                matches!(Filter::parse(bad), Err(Error::InvalidArgument(_))),
                "{bad:?} should be rejected"
            );
        }
    }
}

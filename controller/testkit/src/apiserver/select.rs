//! Label and field selectors of the test API server.

use serde_json::Value;

/// One term of a label or field selector.
pub(super) enum Term {
    Eq(String, String),
    Ne(String, String),
    Exists(String),
    NotExists(String),
}

pub(super) fn parse_selector(s: &str) -> Vec<Term> {
    s.split(',')
        .filter(|t| !t.is_empty())
        .map(|t| {
            if let Some((k, v)) = t.split_once("!=") {
                Term::Ne(k.trim().to_string(), v.trim().to_string())
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Term::Eq(k.trim().to_string(), v.trim().to_string())
            } else if let Some(k) = t.strip_prefix('!') {
                Term::NotExists(k.trim().to_string())
            } else {
                Term::Exists(t.trim().to_string())
            }
        })
        .collect()
}

fn selector_matches(terms: &[Term], lookup: impl Fn(&str) -> Option<String>) -> bool {
    terms.iter().all(|t| match t {
        Term::Eq(k, v) => lookup(k).as_deref() == Some(v.as_str()),
        Term::Ne(k, v) => lookup(k).as_deref() != Some(v.as_str()),
        Term::Exists(k) => lookup(k).is_some(),
        Term::NotExists(k) => lookup(k).is_none(),
    })
}

pub(super) struct Filter {
    pub(super) api: String,
    pub(super) plural: String,
    pub(super) namespace: Option<String>,
    pub(super) labels: Vec<Term>,
    pub(super) fields: Vec<Term>,
}

impl Filter {
    pub(super) fn matches(&self, api: &str, plural: &str, namespace: &str, obj: &Value) -> bool {
        if api != self.api
            || plural != self.plural
            || self.namespace.as_deref().is_some_and(|n| n != namespace)
        {
            return false;
        }
        let labels = &obj["metadata"]["labels"];
        let label_ok = selector_matches(&self.labels, |k| {
            labels.get(k).and_then(Value::as_str).map(String::from)
        });
        let field_ok = selector_matches(&self.fields, |path| {
            let mut v = obj;
            for part in path.split('.') {
                v = v.get(part)?;
            }
            v.as_str().map(String::from)
        });
        label_ok && field_ok
    }
}

//! Waiting on a Twig object's condition by watching it (`kubectl twig wait`, and `--wait`).

use std::time::Duration;

use kube::api::{Api, DynamicObject};
use kube::runtime::wait::await_condition;
use serde_json::Value;

use crate::error::Error;
use crate::kind::Kind;

/// What to wait for (`--for`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A condition of `status.conditions` with this status.
    Condition {
        /// The condition's type (`Ready`).
        type_: String,
        /// Its status (`True`).
        status: String,
    },
    /// The object is gone.
    Delete,
}

impl Target {
    /// `condition=Ready` (status True).
    pub fn ready() -> Self {
        Target::Condition {
            type_: "Ready".into(),
            status: "True".into(),
        }
    }

    /// Parses `--for`: `condition=TYPE[=STATUS]` or `delete`.
    pub fn parse(text: &str) -> Result<Self, Error> {
        if text.eq_ignore_ascii_case("delete") {
            return Ok(Target::Delete);
        }
        let Some(rest) = text.strip_prefix("condition=") else {
            return Err(Error::Usage(format!(
                "unrecognized condition: {text:?} (use condition=TYPE[=STATUS] or delete)"
            )));
        };
        let (type_, status) = rest.split_once('=').unwrap_or((rest, "True"));
        if type_.is_empty() || status.is_empty() {
            return Err(Error::Usage(format!("invalid condition: {text:?}")));
        }
        Ok(Target::Condition {
            type_: type_.into(),
            status: status.into(),
        })
    }

    fn met(&self, obj: Option<&DynamicObject>) -> bool {
        match (self, obj) {
            (Target::Delete, None) => true,
            (Target::Delete, Some(_)) | (Target::Condition { .. }, None) => false,
            (Target::Condition { type_, status }, Some(obj)) => conditions(obj).any(|c| {
                str_field(c, "type").eq_ignore_ascii_case(type_)
                    && str_field(c, "status").eq_ignore_ascii_case(status)
            }),
        }
    }

    /// Waiting for Ready=True gives up when the object fails (it never becomes Ready).
    fn gives_up_on_failure(&self) -> bool {
        *self == Target::ready()
    }
}

fn conditions(obj: &DynamicObject) -> impl Iterator<Item = &Value> {
    obj.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
}

fn str_field<'a>(value: &'a Value, field: &str) -> &'a str {
    value[field].as_str().unwrap_or_default()
}

/// The failure of an object in a phase it will not leave (`Failed`, `Lost`).
pub fn failure(kind: Kind, obj: &DynamicObject) -> Option<Error> {
    let status = &obj.data["status"];
    let phase = status["phase"].as_str()?;
    if !matches!(phase, "Failed" | "Lost") {
        return None;
    }
    let message = status["message"]
        .as_str()
        .filter(|m| !m.is_empty())
        .or_else(|| status["error"]["message"].as_str())
        .or_else(|| {
            conditions(obj)
                .find(|c| str_field(c, "type") == "Failure")
                .map(|c| str_field(c, "message"))
        })
        .unwrap_or("no message")
        .to_string();
    Some(Error::Failed {
        object: kind.object_name(obj.metadata.name.as_deref().unwrap_or_default()),
        phase: phase.to_ascii_lowercase(),
        message,
    })
}

/// Waits at most `timeout` for `target` on `kind`/`name`, watching the object.
/// Returns the object as last seen (`None` once deleted). An object that does
/// not exist when the wait starts is an error, as with `kubectl wait` (unless
/// waiting for its deletion).
pub async fn until(
    kind: Kind,
    api: &Api<DynamicObject>,
    name: &str,
    target: &Target,
    timeout: Duration,
) -> Result<Option<DynamicObject>, Error> {
    let current = match api.get(name).await {
        Ok(current) => current,
        // As kubectl wait: an object already gone is deleted.
        Err(kube::Error::Api(status)) if status.code == 404 && *target == Target::Delete => {
            return Ok(None)
        }
        Err(e) => return Err(e.into()),
    };
    let settled = |obj: Option<&DynamicObject>| {
        target.met(obj)
            || (target.gives_up_on_failure() && obj.is_some_and(|o| failure(kind, o).is_some()))
    };
    let seen = if settled(Some(&current)) {
        Some(current)
    } else if timeout.is_zero() {
        return Err(Error::Timeout(kind.plural_name(name)));
    } else {
        let uid = current.metadata.uid.clone();
        // The same name with another UID is another object: the one waited on is gone.
        let same_object =
            move |obj: Option<&DynamicObject>| obj.filter(|o| o.metadata.uid == uid).cloned();
        let watched = await_condition(api.clone(), name, |obj: Option<&DynamicObject>| {
            settled(same_object(obj).as_ref())
        });
        let seen = tokio::time::timeout(timeout, watched)
            .await
            .map_err(|_| Error::Timeout(kind.plural_name(name)))?
            .map_err(|e| Error::Client(format!("watching {}: {e}", kind.plural_name(name))))?;
        seen.and_then(|o| same_object(Some(&o)))
    };
    if !target.met(seen.as_ref()) {
        if let Some(error) = seen.as_ref().and_then(|o| failure(kind, o)) {
            return Err(error);
        }
    }
    Ok(seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        assert_eq!(Target::parse("condition=Ready").ok(), Some(Target::ready()));
        assert_eq!(
            Target::parse("condition=Failure=False").ok(),
            Some(Target::Condition {
                type_: "Failure".into(),
                status: "False".into()
            })
        );
        assert_eq!(Target::parse("delete").ok(), Some(Target::Delete));
        for bad in ["Ready", "condition=", "jsonpath={.x}", "condition==True"] {
            assert!(Target::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}

//! Server-side field validation (`fieldValidation=Strict|Warn|Ignore`, Warn
//! when absent, as in kube-apiserver): fields of a request body that the
//! kind does not define. A custom resource is checked against its CRD's
//! schema; a built-in kind (Pod, Node, Event) against its k8s-openapi type,
//! whose round trip drops what it does not know; `metadata` against
//! `ObjectMeta`. Strict refuses the request (400), Warn answers with a
//! `Warning` header per field. Unknown fields a request is not refused for
//! are kept (this server does not prune).

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use std::collections::BTreeMap;

use hyper::Method;

use super::discovery::{find, Resource};
use super::{State, Target};

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Fields of `value` its structural `schema` does not declare.
fn schema_unknown(schema: &Value, value: &Value, path: &str, out: &mut Vec<String>) {
    if schema["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true) {
        return;
    }
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                if let Some(prop) = schema["properties"].get(k) {
                    schema_unknown(prop, v, &join(path, k), out);
                } else if let Some(additional) = schema.get("additionalProperties") {
                    if additional.is_object() {
                        schema_unknown(additional, v, &join(path, k), out);
                    }
                } else {
                    out.push(join(path, k));
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                schema_unknown(&schema["items"], item, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Fields of `sent` (non-null) that are missing from `kept`, its round trip through a type.
fn lost(sent: &Value, kept: &Value, path: &str, out: &mut Vec<String>) {
    match (sent, kept) {
        (Value::Object(s), Value::Object(k)) => {
            for (field, v) in s {
                match k.get(field) {
                    Some(kv) => lost(v, kv, &join(path, field), out),
                    None if !v.is_null() => out.push(join(path, field)),
                    None => {}
                }
            }
        }
        (Value::Array(s), Value::Array(k)) => {
            for (i, (sv, kv)) in s.iter().zip(k).enumerate() {
                lost(sv, kv, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// `value` without the null members of its objects, at any depth.
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
    body: &Value,
) -> Result<Value, String> {
    let typed: T = serde_json::from_value(body.clone()).map_err(|e| e.to_string())?;
    serde_json::to_value(typed).map_err(|e| e.to_string())
}

/// The unknown fields of `body`, a whole object or a patch of one (`partial`:
/// a built-in kind's patch is not checked, as it need not deserialize).
/// `Err` is a body its built-in kind cannot decode at all.
pub(super) fn unknown(
    resource: &Resource,
    body: &Value,
    partial: bool,
) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    if resource.schema.is_some() || partial {
        if let Some(meta) = body.get("metadata").filter(|m| m.is_object()) {
            // In a merge patch a null removes the field; it is no field of its own.
            let meta = if partial { &without_nulls(meta) } else { meta };
            lost(meta, &round_trip::<ObjectMeta>(meta)?, "metadata", &mut out);
        }
    }
    match &resource.schema {
        Some(schema) => {
            if let Value::Object(map) = body {
                for (k, v) in map {
                    if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                        continue;
                    }
                    match schema["properties"].get(k) {
                        Some(prop) => schema_unknown(prop, v, k, &mut out),
                        None => out.push(k.clone()),
                    }
                }
            }
        }
        None if partial => {}
        None => {
            let kept = match resource.kind.as_str() {
                "Pod" => round_trip::<Pod>(body)?,
                "Node" => round_trip::<Node>(body)?,
                "Event" => round_trip::<Event>(body)?,
                _ => return Ok(out),
            };
            lost(body, &kept, "", &mut out);
        }
    }
    Ok(out)
}

/// Server-side field validation of a write: `Err` is the
/// message of a Strict request's refusal (400), `Ok` the `Warning` headers of
/// a Warn one.
pub(super) fn validate(
    state: &State,
    target: &Target,
    method: &Method,
    content_type: &str,
    params: &BTreeMap<String, String>,
    body: &[u8],
) -> Result<Vec<String>, String> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    let partial = match (method, media) {
        (&Method::POST | &Method::PUT, _) => false,
        (&Method::PATCH, "application/merge-patch+json") => true,
        (&Method::PATCH, "application/apply-patch+yaml") => false,
        _ => return Ok(Vec::new()),
    };
    let directive = params.get("fieldValidation").map_or("Warn", String::as_str);
    if directive == "Ignore" {
        return Ok(Vec::new());
    }
    let Some(resource) = find(state, &target.api, &target.plural) else {
        return Ok(Vec::new());
    };
    let Ok(value) = serde_json::from_slice::<Value>(body)
        .or_else(|_| serde_saphyr::from_slice::<Value>(body).map_err(|e| e.to_string()))
    else {
        return Ok(Vec::new());
    };
    let cannot = |why: String| {
        let message = format!(
            "{kind} in version \"{version}\" cannot be handled as a {kind}: {why}",
            kind = resource.kind,
            version = resource.version
        );
        message
    };
    let unknown = unknown(&resource, &value, partial).map_err(cannot)?;
    if unknown.is_empty() {
        return Ok(Vec::new());
    }
    if directive == "Strict" {
        let list: Vec<String> = unknown
            .iter()
            .map(|f| format!("unknown field \"{f}\""))
            .collect();
        return Err(cannot(format!(
            "strict decoding error: {}",
            list.join(", ")
        )));
    }
    Ok(unknown
        .iter()
        .map(|f| format!("299 - \"unknown field \\\"{f}\\\"\""))
        .collect())
}

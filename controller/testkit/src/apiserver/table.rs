//! Server-side printing: a `meta.k8s.io/v1` Table for a client that asks
//! for one (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`, what
//! `kubectl get` sends). Its columns are Name and a custom resource's
//! `additionalPrinterColumns` (Name and Age for a kind without them, and for
//! the built-in kinds, whose own printers this server does not have), with
//! cells as kube-apiserver fills them: JSONPath results, `date` columns as
//! ages ("5s", "3m2s"), a missing value as null.

use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};

use std::collections::BTreeMap;

use hyper::{Response, StatusCode};

use super::discovery::{find, Resource};
use super::{full, status_error, Body, State, Target};

/// The media type of a Table response.
pub(super) const TABLE_CONTENT_TYPE: &str = "application/json;as=Table;v=v1;g=meta.k8s.io";

/// Whether the `Accept` header asks for a `meta.k8s.io/v1` Table.
pub(super) fn wanted(accept: &str) -> bool {
    accept.split(',').any(|media| {
        let params: Vec<&str> = media.split(';').map(str::trim).collect();
        params.contains(&"as=Table")
            && params.contains(&"v=v1")
            && params.contains(&"g=meta.k8s.io")
    })
}

fn columns(resource: &Resource) -> Vec<Value> {
    let mut columns = resource.columns.clone();
    if columns.is_empty() {
        columns.push(
            json!({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}),
        );
    }
    columns
}

/// The Table of `objects`; `include` is the `includeObject` parameter
/// (None, Object, or the default PartialObjectMetadata). `Err` names a
/// printer column whose JSONPath this server cannot evaluate.
pub(super) fn table(
    resource: &Resource,
    objects: &[&Value],
    resource_version: &str,
    include: Option<&str>,
) -> Result<Value, String> {
    let columns = columns(resource);
    let mut definitions = vec![json!({
        "name": "Name", "type": "string", "format": "name", "priority": 0,
        "description": "Name must be unique within a namespace.",
    })];
    for c in &columns {
        definitions.push(json!({
            "name": c["name"], "type": c["type"], "format": c.get("format").cloned().unwrap_or(json!("")),
            "description": c.get("description").cloned().unwrap_or(json!("")),
            "priority": c.get("priority").cloned().unwrap_or(json!(0)),
        }));
    }
    let mut rows = Vec::new();
    for obj in objects {
        let mut cells = vec![obj["metadata"]["name"].clone()];
        for c in &columns {
            let path = c["jsonPath"].as_str().unwrap_or_default();
            let value = evaluate(obj, path)?;
            cells.push(cell(c["type"].as_str().unwrap_or("string"), value));
        }
        let mut row = json!({ "cells": cells });
        match include {
            Some("None") => {}
            Some("Object") => row["object"] = (*obj).clone(),
            _ => {
                row["object"] = json!({
                    "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                })
            }
        }
        rows.push(row);
    }
    Ok(json!({
        "kind": "Table", "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }))
}

fn cell(ty: &str, value: Option<&Value>) -> Value {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Value::Null;
    };
    match (ty, value) {
        ("date", Value::String(s)) => match s.parse::<Timestamp>() {
            Ok(t) => json!(human_duration(Timestamp::now().as_second() - t.as_second())),
            Err(_) => json!("<unknown>"),
        },
        ("string", Value::String(s)) => json!(s),
        ("string", other) => json!(other.to_string()),
        ("integer" | "number" | "boolean", v) => v.clone(),
        (_, v) => v.clone(),
    }
}

/// An age as kubectl prints it (apimachinery's `duration.HumanDuration`).
pub(super) fn human_duration(seconds: i64) -> String {
    if seconds < -1 {
        return "<invalid>".into();
    }
    let s = seconds.max(0);
    let (m, h) = (s / 60, s / 3600);
    match () {
        () if s < 120 => format!("{s}s"),
        () if m < 10 && s % 60 == 0 => format!("{m}m"),
        () if m < 10 => format!("{m}m{}s", s % 60),
        () if m < 180 => format!("{m}m"),
        () if h < 8 && m % 60 == 0 => format!("{h}h"),
        () if h < 8 => format!("{h}h{}m", m % 60),
        () if h < 48 => format!("{h}h"),
        () if h < 192 && h % 24 == 0 => format!("{}d", h / 24),
        () if h < 192 => format!("{}d{}h", h / 24, h % 24),
        () if h < 24 * 365 * 2 => format!("{}d", h / 24),
        () if h < 24 * 365 * 8 => format!("{}y{}d", h / 24 / 365, (h / 24) % 365),
        () => format!("{}y", h / 24 / 365),
    }
}

/// The first result of a printer column's JSONPath: fields (`.a.b`),
/// indexes (`[0]`) and equality filters (`[?(@.type=="Ready")]`).
fn evaluate<'a>(obj: &'a Value, path: &str) -> Result<Option<&'a Value>, String> {
    let unsupported =
        || format!("printer column JSONPath {path} is not supported by the test API server");
    let mut current = Some(obj);
    let mut rest = path.trim_start_matches('{').trim_end_matches('}');
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix('.') {
            let end = after.find(['.', '[']).unwrap_or(after.len());
            let field = &after[..end];
            current = current.and_then(|v| v.get(field));
            rest = &after[end..];
        } else if let Some(after) = rest.strip_prefix("[?(@.") {
            let end = after.find(")]").ok_or_else(unsupported)?;
            let (field, wanted) = after[..end].split_once("==").ok_or_else(unsupported)?;
            let wanted = wanted.trim().trim_matches(['"', '\'']);
            current = current.and_then(Value::as_array).and_then(|items| {
                items
                    .iter()
                    .find(|i| i[field.trim()].as_str() == Some(wanted))
            });
            rest = &after[end + 2..];
        } else if let Some(after) = rest.strip_prefix('[') {
            let end = after.find(']').ok_or_else(unsupported)?;
            let index: usize = after[..end].parse().map_err(|_| unsupported())?;
            current = current.and_then(|v| v.get(index));
            rest = &after[end + 1..];
        } else {
            return Err(unsupported());
        }
    }
    Ok(current)
}

/// The response with the Table of `objects` of `target`.
pub(super) fn respond(
    state: &State,
    target: &Target,
    objects: &[&Value],
    rv: &str,
    params: &BTreeMap<String, String>,
) -> Response<Body> {
    let Some(resource) = find(state, &target.api, &target.plural) else {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("the server does not serve {}/{}", target.api, target.plural),
        );
    };
    let include = params.get("includeObject").map(String::as_str);
    match table(&resource, objects, rv, include) {
        Ok(table) => {
            let mut resp = full(StatusCode::OK, &table);
            resp.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(TABLE_CONTENT_TYPE),
            );
            resp
        }
        Err(e) => status_error(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", e),
    }
}

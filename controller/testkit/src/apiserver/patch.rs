//! PATCH of the test API server: JSON merge patch, JSON Patch and
//! server-side apply.

use hyper::StatusCode;
use serde_json::{json, Value};

use super::{
    api_version, conflict, create, key, kind_of, lock, not_found, split_status, stale,
    status_error, update, updater, writer, Body, State, Target, Write,
};
use crate::ssa;
use hyper::Response;

fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            for (k, v) in p {
                if v.is_null() {
                    if let Some(t) = target.as_object_mut() {
                        t.remove(k);
                    }
                } else {
                    merge(&mut target[k.as_str()], v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// JSON merge patch (RFC 7386).
pub(super) fn merge_patch(
    state: &State,
    target: &Target,
    name: &str,
    patch: &Value,
    status: bool,
    manager: &str,
) -> Response<Body> {
    let k = key(target, name);
    let mut inner = lock(state);
    let Some(stored) = inner.objects.get(&k).cloned() else {
        return not_found(target, name);
    };
    if stale(patch["metadata"]["resourceVersion"].as_str(), &stored) {
        return conflict(target, name);
    }
    let mut patched = stored.clone();
    merge(&mut patched, patch);
    let new = split_status(&stored, patched, status, &target.plural);
    update(
        state,
        &mut inner,
        &k,
        &stored,
        new,
        updater(target, status, manager),
    )
}

/// JSON Patch (RFC 6902). Like kube-apiserver (evanphx/json-patch), a
/// `test` of `null` passes when the field is missing.
pub(super) fn json_patch(
    state: &State,
    target: &Target,
    name: &str,
    patch: &Value,
    status: bool,
    manager: &str,
) -> Response<Body> {
    let ops: json_patch::Patch = match serde_json::from_value(patch.clone()) {
        Ok(ops) => ops,
        Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
    };
    let k = key(target, name);
    let mut inner = lock(state);
    let Some(stored) = inner.objects.get(&k).cloned() else {
        return not_found(target, name);
    };
    let mut patched = stored.clone();
    for op in ops.0 {
        if let json_patch::PatchOperation::Test(t) = &op {
            let missing = t.path.resolve(&patched).is_err();
            if t.value.is_null() && missing {
                continue;
            }
        }
        if let Err(e) = json_patch::patch(&mut patched, &[op]) {
            return status_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                format!("the server rejected our request due to an error in our request: {e}"),
            );
        }
    }
    let new = split_status(&stored, patched, status, &target.plural);
    update(
        state,
        &mut inner,
        &k,
        &stored,
        new,
        updater(target, status, manager),
    )
}

/// Server-side apply of `applied` by `manager`.
pub(super) fn server_side_apply(
    state: &State,
    target: &Target,
    name: &str,
    applied: &Value,
    status: bool,
    manager: &str,
    force: bool,
) -> Response<Body> {
    let version = api_version(&target.api);
    let kind = kind_of(&target.plural);
    if applied["apiVersion"].as_str() != Some(version.as_str())
        || applied["kind"].as_str() != Some(kind)
    {
        let message = format!(
            "the applied object must be apiVersion {version}, kind {kind}, not {} {}",
            applied["apiVersion"], applied["kind"]
        );
        return status_error(StatusCode::BAD_REQUEST, "BadRequest", message);
    }
    if applied["metadata"]["name"].as_str() != Some(name) {
        let message = format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            applied["metadata"]["name"]
        );
        return status_error(StatusCode::BAD_REQUEST, "BadRequest", message);
    }
    let k = key(target, name);
    let schema = state.schema(&target.plural);
    let w = writer(target, status, manager);
    let mut inner = lock(state);
    let Some(stored) = inner.objects.get(&k).cloned() else {
        if status {
            return not_found(target, name);
        }
        // Apply creates a missing object.
        let Ok((obj, _)) = ssa::apply(&json!({}), &[], applied, &schema, &w, force) else {
            return status_error(
                StatusCode::CONFLICT,
                "Conflict",
                "conflict on a new object".into(),
            );
        };
        drop(inner);
        return create(state, target, obj, manager);
    };
    if stale(applied["metadata"]["resourceVersion"].as_str(), &stored) {
        return conflict(target, name);
    }
    let managers = inner.managed.get(&k).cloned().unwrap_or_default();
    match ssa::apply(&stored, &managers, applied, &schema, &w, force) {
        Ok((merged, managers)) => {
            let new = split_status(&stored, merged, status, &target.plural);
            let write = Write {
                writer: w,
                managers: Some(managers),
            };
            update(state, &mut inner, &k, &stored, new, write)
        }
        Err(conflicts) => status_error(StatusCode::CONFLICT, "Conflict", conflicts.message()),
    }
}

//! ValidatingAdmissionPolicies in force on the server (the chart's, given by
//! a test with [`super::TestApiServer::enforce`]), evaluated by
//! [`crate::admission`] on the creates, updates and deletes of callers that
//! say who they are: kube-apiserver's `request.userInfo` comes from the
//! headers [`USER_HEADER`] (the username) and [`EXTRA_HEADER`] (`key=value`,
//! one header per value), as a test's stand-in for a bearer token.
//! Anonymous requests (the tests' own) are not checked.

use std::cell::RefCell;
use std::collections::BTreeMap;

use hyper::{HeaderMap, Response, StatusCode};
use serde_json::Value;

use super::{status_error, Body, State};
use crate::admission::{self, Request, Verdict};

/// The header naming the caller's username.
pub const USER_HEADER: &str = "x-test-user";
/// A header holding one `key=value` of the caller's extra info.
pub const EXTRA_HEADER: &str = "x-test-user-extra";

/// Who sends the request being served, and to which subresource.
pub(super) struct Caller {
    username: String,
    extra: BTreeMap<String, Vec<String>>,
    subresource: Option<String>,
}

thread_local! {
    /// The caller of the request this thread serves (writes are synchronous).
    static CALLER: RefCell<Option<Caller>> = const { RefCell::new(None) };
}

/// The caller the headers name, if any.
pub(super) fn caller(headers: &HeaderMap, subresource: Option<&str>) -> Option<Caller> {
    let username = headers.get(USER_HEADER)?.to_str().ok()?.to_string();
    let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for value in headers.get_all(EXTRA_HEADER) {
        if let Some((k, v)) = value.to_str().ok().and_then(|s| s.split_once('=')) {
            extra.entry(k.to_string()).or_default().push(v.to_string());
        }
    }
    Some(Caller {
        username,
        extra,
        subresource: subresource.map(str::to_string),
    })
}

/// Runs `serve` (synchronous) as `caller`'s request.
pub(super) fn serve_as<R>(caller: Option<Caller>, serve: impl FnOnce() -> R) -> R {
    CALLER.with(|c| *c.borrow_mut() = caller);
    let response = serve();
    CALLER.with(|c| *c.borrow_mut() = None);
    response
}

/// The refusal of the policies in force for a write of `object` over `old`
/// (`object` alone: create; `old` alone: delete) to `plural` of `api`
/// (`api/v1`, `apis/<group>/<version>`) by the current caller.
pub(super) fn check(
    state: &State,
    api: &str,
    plural: &str,
    object: Option<&Value>,
    old: Option<&Value>,
) -> Option<Response<Body>> {
    let policies = state
        .policies
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if policies.is_empty() {
        return None;
    }
    CALLER.with(|current| {
        let current = current.borrow();
        let caller = current.as_ref()?;
        let mut parts = api.split('/').skip(1).collect::<Vec<_>>();
        let version = parts.pop().unwrap_or_default();
        let group = parts.pop().unwrap_or_default();
        let resource = match &caller.subresource {
            Some(sub) => format!("{plural}/{sub}"),
            None => plural.to_string(),
        };
        let req = Request::write(
            (group, version, &resource),
            &caller.username,
            &caller.extra,
            object,
            old,
        );
        for (policy, binding) in policies.iter() {
            let (message, reason) = match admission::evaluate(policy, binding, &req) {
                Ok(Verdict::Allowed) => continue,
                Ok(Verdict::Denied { message, reason }) => (message, reason),
                Err(e) => (e, "InternalError".to_string()),
            };
            let code = match reason.as_str() {
                "Forbidden" => StatusCode::FORBIDDEN,
                "InternalError" => StatusCode::INTERNAL_SERVER_ERROR,
                _ => StatusCode::UNPROCESSABLE_ENTITY,
            };
            // kube-apiserver's words.
            let message = format!(
                "{plural} is forbidden: ValidatingAdmissionPolicy '{}' with binding '{}' denied request: {message}",
                policy["metadata"]["name"].as_str().unwrap_or_default(),
                binding["metadata"]["name"].as_str().unwrap_or_default(),
            );
            return Some(status_error(code, &reason, message));
        }
        None
    })
}

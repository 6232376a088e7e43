//! Who asked for what, as RBAC sees a request (verb, API group, resource
//! with its subresource): recorded per actor for the RBAC checks, and
//! refused with kube-apiserver's 403 when a test has forbidden it.

use std::collections::BTreeMap;

use hyper::{Method, Response, StatusCode};

use super::{status_error, Access, Body, State, Target};

/// The user kube-apiserver names for a request without credentials.
const ANONYMOUS: &str = "system:anonymous";

/// The access a request makes; `actor` is empty when the request named none.
pub(super) fn access(
    target: &Target,
    method: &Method,
    params: &BTreeMap<String, String>,
    actor: Option<&str>,
) -> Access {
    let verb = match (method, target.name.is_some()) {
        (&Method::GET, false) if params.get("watch").is_some_and(|w| w == "true" || w == "1") => {
            "watch"
        }
        (&Method::GET, false) => "list",
        (&Method::GET, true) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, _) => "delete",
        _ => "unknown",
    };
    let group = target
        .api
        .strip_prefix("apis/")
        .and_then(|gv| gv.split('/').next())
        .unwrap_or_default();
    let resource = match &target.subresource {
        Some(sub) => format!("{}/{sub}", target.plural),
        None => target.plural.clone(),
    };
    Access {
        actor: actor.unwrap_or_default().to_string(),
        verb: verb.to_string(),
        group: group.to_string(),
        resource,
    }
}

/// Records `access` (when it names its actor); the 403 when it is forbidden.
pub(super) fn check(state: &State, target: &Target, access: Access) -> Option<Response<Body>> {
    let refused = state
        .forbidden
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .contains(&(
            access.verb.clone(),
            access.group.clone(),
            access.resource.clone(),
        ));
    let response = refused.then(|| forbidden(target, &access));
    if !access.actor.is_empty() {
        state
            .requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(access);
    }
    response
}

/// kube-apiserver's words: `pods "x" is forbidden: User "u" cannot get
/// resource "pods/proxy" in API group "" in the namespace "ns"`.
fn forbidden(target: &Target, access: &Access) -> Response<Body> {
    let user = if access.actor.is_empty() {
        ANONYMOUS
    } else {
        &access.actor
    };
    let object = match &target.name {
        Some(name) => format!("{} \"{name}\"", target.plural),
        None => target.plural.clone(),
    };
    let scope = match &target.namespace {
        Some(ns) => format!(" in the namespace \"{ns}\""),
        None => " at the cluster scope".to_string(),
    };
    status_error(
        StatusCode::FORBIDDEN,
        "Forbidden",
        format!(
            "{object} is forbidden: User \"{user}\" cannot {} resource \"{}\" in API group \"{}\"{scope}",
            access.verb, access.resource, access.group
        ),
    )
}

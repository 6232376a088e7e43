//! What kubectl asks before it acts: the version, API discovery (the
//! legacy `/api`, `/apis` and per-group-version resource lists; a client
//! asking for aggregated discovery gets these, as from a server that does not
//! serve it) and OpenAPI v3 (`/openapi/v3` and one document per group
//! version), whose PATCH operations declare `fieldValidation`, so kubectl
//! leaves field validation to the server.

use std::collections::BTreeMap;

use hyper::{Response, StatusCode};
use serde_json::{json, Value};

use super::{full, status_error, Body, State};

/// One resource the server serves.
pub(super) struct Resource {
    pub(super) group: String,
    pub(super) version: String,
    pub(super) plural: String,
    pub(super) singular: String,
    pub(super) kind: String,
    pub(super) namespaced: bool,
    pub(super) short_names: Vec<String>,
    pub(super) categories: Vec<String>,
    pub(super) status: bool,
    /// The CRD's `additionalPrinterColumns` (empty for built-in kinds).
    pub(super) columns: Vec<Value>,
    /// The CRD's `openAPIV3Schema` (none for built-in kinds).
    pub(super) schema: Option<Value>,
}

impl Resource {
    /// The path prefix of its group version: `api/v1` or `apis/<group>/<version>`.
    pub(super) fn api(&self) -> String {
        if self.group.is_empty() {
            format!("api/{}", self.version)
        } else {
            format!("apis/{}/{}", self.group, self.version)
        }
    }

    fn group_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }
}

fn builtin(
    (group, version, plural, kind, namespaced, short): (&str, &str, &str, &str, bool, &[&str]),
) -> Resource {
    Resource {
        group: group.into(),
        version: version.into(),
        plural: plural.into(),
        singular: kind.to_lowercase(),
        kind: kind.into(),
        namespaced,
        short_names: short.iter().map(|s| s.to_string()).collect(),
        categories: if plural == "pods" {
            vec!["all".into()]
        } else {
            Vec::new()
        },
        status: plural != "events",
        columns: Vec::new(),
        schema: None,
    }
}

/// Every resource: the built-in kinds the server stores, then each CRD's served version.
pub(super) fn resources(state: &State) -> Vec<Resource> {
    let mut all: Vec<Resource> = [
        ("", "v1", "pods", "Pod", true, &["po"][..]),
        ("", "v1", "nodes", "Node", false, &["no"][..]),
        ("events.k8s.io", "v1", "events", "Event", true, &["ev"][..]),
    ]
    .into_iter()
    .map(builtin)
    .collect();
    for crd in state.crds.values() {
        let names = &crd["spec"]["names"];
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect()
        };
        for version in crd["spec"]["versions"].as_array().into_iter().flatten() {
            if version["served"] == json!(false) {
                continue;
            }
            all.push(Resource {
                group: crd["spec"]["group"].as_str().unwrap_or_default().into(),
                version: version["name"].as_str().unwrap_or_default().into(),
                plural: names["plural"].as_str().unwrap_or_default().into(),
                singular: names["singular"].as_str().unwrap_or_default().into(),
                kind: names["kind"].as_str().unwrap_or_default().into(),
                namespaced: crd["spec"]["scope"] != "Cluster",
                short_names: strings(&names["shortNames"]),
                categories: strings(&names["categories"]),
                status: version["subresources"]["status"].is_object(),
                columns: version["additionalPrinterColumns"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
                schema: Some(version["schema"]["openAPIV3Schema"].clone()),
            });
        }
    }
    all
}

/// The resource served at `api` (`api/v1`, `apis/<group>/<version>`) as `plural`.
pub(super) fn find(state: &State, api: &str, plural: &str) -> Option<Resource> {
    resources(state)
        .into_iter()
        .find(|r| r.api() == api && r.plural == plural)
}

const VERBS: &[&str] = &[
    "create", "delete", "get", "list", "patch", "update", "watch",
];

fn resource_list(group_version: &str, resources: &[&Resource]) -> Value {
    let mut list = Vec::new();
    for r in resources {
        list.push(json!({
            "name": r.plural, "singularName": r.singular, "namespaced": r.namespaced,
            "kind": r.kind, "verbs": VERBS, "shortNames": r.short_names,
            "categories": r.categories,
        }));
        if r.status {
            list.push(json!({
                "name": format!("{}/status", r.plural), "singularName": "",
                "namespaced": r.namespaced, "kind": r.kind, "verbs": ["get", "patch", "update"],
            }));
        }
    }
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": list})
}

/// Groups (other than the core one) and their versions, in order.
fn groups(all: &[Resource]) -> BTreeMap<String, Vec<String>> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in all.iter().filter(|r| !r.group.is_empty()) {
        let versions = groups.entry(r.group.clone()).or_default();
        if !versions.contains(&r.version) {
            versions.push(r.version.clone());
        }
    }
    groups
}

/// A GET of a discovery or OpenAPI path; `None` for any other path.
pub(super) fn serve(state: &State, path: &str) -> Option<Response<Body>> {
    let all = resources(state);
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let body = match segs.as_slice() {
        ["version"] => json!({
            "major": "1", "minor": "30", "gitVersion": "v1.30.0-twig-test",
            "platform": "linux/amd64",
        }),
        ["api"] => {
            json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        }
        ["apis"] => {
            let list: Vec<Value> = groups(&all)
                .into_iter()
                .map(|(name, versions)| {
                    let versions: Vec<Value> = versions
                        .iter()
                        .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
                        .collect();
                    json!({"name": name, "preferredVersion": versions[0], "versions": versions})
                })
                .collect();
            json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": list})
        }
        ["api", _] | ["apis", _, _] => {
            let api = segs.join("/");
            let served: Vec<&Resource> = all.iter().filter(|r| r.api() == api).collect();
            if served.is_empty() {
                return Some(not_served(path));
            }
            resource_list(&served[0].group_version(), &served)
        }
        ["openapi", "v3"] => {
            let mut paths = BTreeMap::new();
            for r in &all {
                paths.insert(
                    r.api(),
                    json!({"serverRelativeURL": format!("/openapi/v3/{}?hash=test", r.api())}),
                );
            }
            json!({ "paths": paths })
        }
        ["openapi", "v3", rest @ ..] => {
            let api = rest.join("/");
            let served: Vec<&Resource> = all.iter().filter(|r| r.api() == api).collect();
            if served.is_empty() {
                return Some(not_served(path));
            }
            openapi_document(&served)
        }
        _ => return None,
    };
    Some(full(StatusCode::OK, &body))
}

fn not_served(path: &str) -> Response<Body> {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("the server could not find the requested resource ({path})"),
    )
}

/// The OpenAPI v3 name of a kind's schema, as kube-apiserver names it.
fn schema_name(r: &Resource) -> String {
    let group = if r.group.is_empty() {
        "io.k8s.api.core".to_string()
    } else {
        r.group.split('.').rev().collect::<Vec<_>>().join(".")
    };
    format!("{group}.{}.{}", r.version, r.kind)
}

/// The OpenAPI v3 document of one group version: per resource its paths
/// (with the query parameters the server accepts on each operation) and,
/// for custom resources, the CRD's schema.
fn openapi_document(resources: &[&Resource]) -> Value {
    let mut paths = serde_json::Map::new();
    let mut schemas = serde_json::Map::new();
    for r in resources {
        let gvk = json!({"group": r.group, "version": r.version, "kind": r.kind});
        let reference = json!({"$ref": format!("#/components/schemas/{}", schema_name(r))});
        let query = |names: &[&str]| -> Vec<Value> {
            names
                .iter()
                .map(|n| json!({"name": n, "in": "query", "schema": {"type": "string", "uniqueItems": true}}))
                .collect()
        };
        let op = |action: &str, params: &[&str]| {
            json!({
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": query(params),
                "responses": {"200": {"content": {"application/json": {"schema": reference}}}},
            })
        };
        let writes = ["dryRun", "fieldManager", "fieldValidation"];
        let mut patch = writes.to_vec();
        patch.push("force");
        let base = if r.namespaced {
            format!("/{}/namespaces/{{namespace}}/{}", r.api(), r.plural)
        } else {
            format!("/{}/{}", r.api(), r.plural)
        };
        paths.insert(
            base.clone(),
            json!({"get": op("list", &["labelSelector", "fieldSelector", "watch", "resourceVersion"]),
                   "post": op("post", &writes)}),
        );
        paths.insert(
            format!("{base}/{{name}}"),
            json!({"get": op("get", &[]), "put": op("put", &writes),
                   "patch": op("patch", &patch), "delete": op("delete", &["propagationPolicy"])}),
        );
        if r.status {
            paths.insert(
                format!("{base}/{{name}}/status"),
                json!({"get": op("get", &[]), "put": op("put", &writes), "patch": op("patch", &patch)}),
            );
        }
        let mut schema = r.schema.clone().unwrap_or_else(
            || json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
        );
        schema["x-kubernetes-group-version-kind"] = json!([gvk]);
        schemas.insert(schema_name(r), schema);
    }
    json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.30.0-twig-test"},
        "paths": paths,
        "components": {"schemas": schemas},
    })
}

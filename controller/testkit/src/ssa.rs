//! Field ownership and server-side apply, as kube-apiserver does them
//! (structured-merge-diff): every write records which manager owns which
//! fields (`metadata.managedFields`, FieldsV1); an apply merges the applied
//! configuration into the object by the schema (`x-kubernetes-list-type`
//! `map` lists by their `x-kubernetes-list-map-keys`, `set` lists by value,
//! other lists atomically), refuses to change another manager's field
//! unless forced (then takes it over), and removes the fields the manager
//! applied before and no longer applies, unless another manager owns them.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Map, Value};

/// One field as FieldsV1 names it: `f:<field>`, `k:<keys JSON>` (an item of
/// a map list), `v:<value JSON>` (an item of a set list).
pub type Path = Vec<String>;
/// The fields a manager owns.
pub type FieldSet = BTreeSet<Path>;

/// One `managedFields` entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Manager {
    /// The field manager's name.
    pub manager: String,
    /// `Apply` or `Update`.
    pub operation: &'static str,
    /// `""` (the main resource) or `status`.
    pub subresource: String,
    /// The API version it wrote with.
    pub api_version: String,
    /// When it last wrote (RFC 3339).
    pub time: String,
    /// The fields it owns.
    pub fields: FieldSet,
}

impl Manager {
    fn is(&self, manager: &str, operation: &str, subresource: &str) -> bool {
        self.manager == manager && self.operation == operation && self.subresource == subresource
    }
}

/// Which part of an object a request may change.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Everything but `status` (when the kind has a status subresource).
    Main {
        /// Whether the kind has a status subresource.
        has_status: bool,
    },
    /// Only `status`.
    Status,
}

impl Scope {
    /// The subresource this scope writes (`""` or `status`).
    pub fn subresource(self) -> &'static str {
        match self {
            Scope::Main { .. } => "",
            Scope::Status => "status",
        }
    }

    fn contains(self, path: &Path) -> bool {
        let status = path.first().is_some_and(|f| f == "f:status");
        match self {
            Scope::Main { has_status } => !(has_status && status),
            Scope::Status => status,
        }
    }
}

/// Fields the server sets, which nobody owns.
const UNOWNED: &[&[&str]] = &[
    &["f:apiVersion"],
    &["f:kind"],
    &["f:metadata", "f:name"],
    &["f:metadata", "f:namespace"],
    &["f:metadata", "f:uid"],
    &["f:metadata", "f:resourceVersion"],
    &["f:metadata", "f:generation"],
    &["f:metadata", "f:creationTimestamp"],
    &["f:metadata", "f:deletionTimestamp"],
    &["f:metadata", "f:deletionGracePeriodSeconds"],
    &["f:metadata", "f:managedFields"],
    &["f:metadata", "f:selfLink"],
];

/// ObjectMeta's list types, which CRD schemas leave out.
fn metadata_schema() -> Value {
    json!({"type": "object", "properties": {
        "finalizers": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["uid"], "items": {"type": "object"}},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    }})
}

/// The schema of a kind (its CRD's `openAPIV3Schema`, or nothing for
/// built-in kinds, whose lists are then all atomic), with ObjectMeta's.
pub struct Schema {
    root: Value,
}

impl Schema {
    /// The schema of a CRD's `openAPIV3Schema`, or of a built-in kind (`None`), with ObjectMeta's added.
    pub fn new(crd: Option<&Value>) -> Self {
        let mut root = crd.cloned().unwrap_or_else(|| json!({"type": "object"}));
        root["properties"]["metadata"] = metadata_schema();
        Self { root }
    }
}

fn child<'a>(schema: Option<&'a Value>, field: &str) -> Option<&'a Value> {
    let s = schema?;
    s.get("properties")
        .and_then(|p| p.get(field))
        .or_else(|| s.get("additionalProperties").filter(|a| a.is_object()))
}

enum ListKind {
    Atomic,
    Set,
    Map(Vec<String>),
}

fn list_kind(schema: Option<&Value>) -> ListKind {
    let Some(s) = schema else {
        return ListKind::Atomic;
    };
    match s["x-kubernetes-list-type"].as_str() {
        Some("set") => ListKind::Set,
        Some("map") => ListKind::Map(
            s["x-kubernetes-list-map-keys"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(String::from)
                .collect(),
        ),
        _ => ListKind::Atomic,
    }
}

fn item_key(item: &Value, keys: &[String]) -> String {
    let map: Map<String, Value> = keys
        .iter()
        .map(|k| (k.clone(), item.get(k).cloned().unwrap_or(Value::Null)))
        .collect();
    format!("k:{}", Value::Object(map))
}

fn walk(v: &Value, schema: Option<&Value>, prefix: &mut Path, out: &mut FieldSet) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, child_value) in map {
                prefix.push(format!("f:{k}"));
                walk(child_value, child(schema, k), prefix, out);
                prefix.pop();
            }
        }
        Value::Array(items) => match list_kind(schema) {
            ListKind::Map(keys) => {
                let items_schema = schema.and_then(|s| s.get("items"));
                for item in items {
                    prefix.push(item_key(item, &keys));
                    out.insert(prefix.clone());
                    walk(item, items_schema, prefix, out);
                    prefix.pop();
                }
            }
            ListKind::Set => {
                for item in items {
                    prefix.push(format!("v:{item}"));
                    out.insert(prefix.clone());
                    prefix.pop();
                }
            }
            ListKind::Atomic => {
                out.insert(prefix.clone());
            }
        },
        _ => {
            out.insert(prefix.clone());
        }
    }
}

/// The fields `obj` sets, within `scope`, without those nobody owns.
pub fn field_set(obj: &Value, schema: &Schema, scope: Scope) -> FieldSet {
    let mut out = FieldSet::new();
    walk(obj, Some(&schema.root), &mut Vec::new(), &mut out);
    out.retain(|p| {
        !p.is_empty()
            && scope.contains(p)
            && !UNOWNED
                .iter()
                .any(|u| p.len() >= u.len() && p.iter().zip(u.iter()).all(|(a, b)| a == b))
    });
    out
}

/// A key field of a map list's item: it stays as long as the item does.
fn is_key_of_item(path: &Path) -> bool {
    let [.., item, field] = path.as_slice() else {
        return false;
    };
    let (Some(keys), Some(field)) = (item.strip_prefix("k:"), field.strip_prefix("f:")) else {
        return false;
    };
    serde_json::from_str::<Map<String, Value>>(keys).is_ok_and(|k| k.contains_key(field))
}

fn is_item(elem: &str) -> bool {
    elem.starts_with("k:") || elem.starts_with("v:")
}

fn matches_item(item: &Value, elem: &str) -> bool {
    if let Some(keys) = elem.strip_prefix("k:") {
        let Ok(Value::Object(keys)) = serde_json::from_str::<Value>(keys) else {
            return false;
        };
        keys.iter()
            .all(|(k, v)| item.get(k).unwrap_or(&Value::Null) == v)
    } else if let Some(value) = elem.strip_prefix("v:") {
        serde_json::from_str::<Value>(value).is_ok_and(|v| &v == item)
    } else {
        false
    }
}

/// The value at `path`, if the object has it.
pub fn lookup<'a>(mut v: &'a Value, path: &[String]) -> Option<&'a Value> {
    for elem in path {
        v = match elem.strip_prefix("f:") {
            Some(field) => v.get(field)?,
            None => v.as_array()?.iter().find(|i| matches_item(i, elem))?,
        };
    }
    Some(v)
}

fn remove_at(v: &mut Value, path: &[String]) {
    let Some((last, parent_path)) = path.split_last() else {
        return;
    };
    let mut parent = v;
    for elem in parent_path {
        let next = match elem.strip_prefix("f:") {
            Some(field) => parent.get_mut(field),
            None => parent
                .as_array_mut()
                .and_then(|a| a.iter_mut().find(|i| matches_item(i, elem))),
        };
        let Some(next) = next else {
            return;
        };
        parent = next;
    }
    match last.strip_prefix("f:") {
        Some(field) => {
            if let Some(o) = parent.as_object_mut() {
                o.remove(field);
            }
        }
        None => {
            if let Some(a) = parent.as_array_mut() {
                a.retain(|i| !matches_item(i, last));
            }
        }
    }
}

/// `applied` merged into `live` by the schema.
fn merge(live: &Value, applied: &Value, schema: Option<&Value>) -> Value {
    match (live, applied) {
        (Value::Object(l), Value::Object(a)) => {
            let mut out = l.clone();
            for (k, av) in a {
                let merged = match l.get(k) {
                    Some(lv) => merge(lv, av, child(schema, k)),
                    None => av.clone(),
                };
                out.insert(k.clone(), merged);
            }
            Value::Object(out)
        }
        (Value::Array(l), Value::Array(a)) => match list_kind(schema) {
            ListKind::Map(keys) => {
                let items_schema = schema.and_then(|s| s.get("items"));
                let mut out = l.clone();
                for item in a {
                    let k = item_key(item, &keys);
                    match out.iter_mut().find(|i| item_key(i, &keys) == k) {
                        Some(existing) => *existing = merge(existing, item, items_schema),
                        None => out.push(item.clone()),
                    }
                }
                Value::Array(out)
            }
            ListKind::Set => {
                let mut out = l.clone();
                for item in a {
                    if !out.contains(item) {
                        out.push(item.clone());
                    }
                }
                Value::Array(out)
            }
            ListKind::Atomic => applied.clone(),
        },
        _ => applied.clone(),
    }
}

/// `.status.nodes[nodeName="a"].ready`, as kube-apiserver prints a field.
pub fn display(path: &Path) -> String {
    let mut out = String::new();
    for elem in path {
        if let Some(field) = elem.strip_prefix("f:") {
            out.push('.');
            out.push_str(field);
        } else if let Some(keys) = elem.strip_prefix("k:") {
            let keys: Map<String, Value> = serde_json::from_str(keys).unwrap_or_default();
            let parts: Vec<String> = keys.iter().map(|(k, v)| format!("{k}={v}")).collect();
            out.push_str(&format!("[{}]", parts.join(",")));
        } else if let Some(value) = elem.strip_prefix("v:") {
            out.push_str(&format!("[{value}]"));
        }
    }
    out
}

/// An apply refused for changing fields other managers own.
pub struct Conflicts(pub Vec<(String, Path)>);

impl Conflicts {
    /// kube-apiserver's message of a 409 from apply.
    pub fn message(&self) -> String {
        let n = self.0.len();
        let list: Vec<String> = self
            .0
            .iter()
            .map(|(m, p)| format!("conflict with \"{m}\": {}", display(p)))
            .collect();
        format!(
            "Apply failed with {n} conflict{}: {}",
            if n == 1 { "" } else { "s" },
            list.join(", ")
        )
    }
}

/// What an operation is: its manager, when, in which scope.
pub struct Writer {
    /// The field manager.
    pub manager: String,
    /// The API version of the request.
    pub api_version: String,
    /// When it writes (RFC 3339).
    pub time: String,
    /// Which part of the object it may change.
    pub scope: Scope,
}

/// Server-side apply of `applied` to `live` (`{}` for a new object):
/// the new object and managers, or the conflicts.
pub fn apply(
    live: &Value,
    managers: &[Manager],
    applied: &Value,
    schema: &Schema,
    writer: &Writer,
    force: bool,
) -> Result<(Value, Vec<Manager>), Conflicts> {
    let sub = writer.scope.subresource();
    let applied = match writer.scope {
        Scope::Status => json!({"status": applied.get("status").cloned().unwrap_or(json!({}))}),
        Scope::Main { has_status } => {
            let mut a = applied.clone();
            if has_status {
                if let Some(o) = a.as_object_mut() {
                    o.remove("status");
                }
            }
            a
        }
    };
    let applied_set = field_set(&applied, schema, writer.scope);
    let mut conflicts = Vec::new();
    let mut taken: Vec<(usize, Path)> = Vec::new();
    for (i, m) in managers.iter().enumerate() {
        if m.is(&writer.manager, "Apply", sub) {
            continue;
        }
        for p in m.fields.intersection(&applied_set) {
            let is_item_marker = p.last().is_some_and(|e| is_item(e));
            if !is_item_marker && lookup(live, p) != lookup(&applied, p) {
                conflicts.push((m.manager.clone(), p.clone()));
                taken.push((i, p.clone()));
            }
        }
    }
    if !conflicts.is_empty() && !force {
        return Err(Conflicts(conflicts));
    }
    let mut new_managers: Vec<Manager> = managers.to_vec();
    for (i, p) in taken {
        new_managers[i].fields.remove(&p);
    }
    let previous = new_managers
        .iter()
        .find(|m| m.is(&writer.manager, "Apply", sub))
        .map(|m| m.fields.clone())
        .unwrap_or_default();
    new_managers.retain(|m| !m.is(&writer.manager, "Apply", sub));
    let others: FieldSet = new_managers
        .iter()
        .flat_map(|m| m.fields.iter().cloned())
        .collect();
    let mut merged = merge(live, &applied, Some(&schema.root));
    let mut released: Vec<&Path> = previous
        .iter()
        .filter(|p| !applied_set.contains(*p) && !others.contains(*p))
        .collect();
    // Shallowest first: an item goes with everything in it, and is found by its keys.
    released.sort_by_key(|p| p.len());
    let mut gone: Vec<&Path> = Vec::new();
    for p in released {
        if gone.iter().any(|g| p.starts_with(g)) || is_key_of_item(p) {
            continue;
        }
        let still_used = others
            .iter()
            .chain(applied_set.iter())
            .any(|o| o.len() > p.len() && o.starts_with(p));
        if !still_used {
            remove_at(&mut merged, p);
            gone.push(p);
        }
    }
    new_managers.push(Manager {
        manager: writer.manager.to_string(),
        operation: "Apply",
        subresource: sub.to_string(),
        api_version: writer.api_version.to_string(),
        time: writer.time.to_string(),
        fields: applied_set,
    });
    new_managers.retain(|m| !m.fields.is_empty());
    Ok((merged, new_managers))
}

/// The managers after a non-apply write (create, update, patch) changed
/// `old` into `new`: the writer owns what it changed, nobody owns what it removed.
pub fn record_update(
    old: &Value,
    new: &Value,
    managers: &[Manager],
    schema: &Schema,
    writer: &Writer,
) -> Vec<Manager> {
    let sub = writer.scope.subresource();
    let old_set = field_set(old, schema, writer.scope);
    let new_set = field_set(new, schema, writer.scope);
    // An item of a map or set list is the writer's when it adds it; its fields when it changes them.
    let changed: FieldSet = new_set
        .iter()
        .filter(|p| {
            if p.last().is_some_and(|e| is_item(e)) {
                lookup(old, p).is_none()
            } else {
                lookup(old, p) != lookup(new, p)
            }
        })
        .cloned()
        .collect();
    let removed: FieldSet = old_set.difference(&new_set).cloned().collect();
    let mut out: Vec<Manager> = managers.to_vec();
    for m in &mut out {
        m.fields
            .retain(|p| !changed.contains(p) && !removed.contains(p));
    }
    if !changed.is_empty() {
        match out
            .iter_mut()
            .find(|m| m.is(&writer.manager, "Update", sub))
        {
            Some(m) => {
                m.fields.extend(changed);
                m.time = writer.time.to_string();
                m.api_version = writer.api_version.to_string();
            }
            None => out.push(Manager {
                manager: writer.manager.to_string(),
                operation: "Update",
                subresource: sub.to_string(),
                api_version: writer.api_version.to_string(),
                time: writer.time.to_string(),
                fields: changed,
            }),
        }
    }
    out.retain(|m| !m.fields.is_empty());
    out
}

/// FieldsV1 of a field set: nested objects, `{}` leaves, `".": {}` for a
/// field owned together with fields below it.
pub fn fields_v1(set: &FieldSet) -> Value {
    let mut root = json!({});
    for path in set {
        let mut node = &mut root;
        for elem in path {
            node = node
                .as_object_mut()
                .map(|o| o.entry(elem.clone()).or_insert_with(|| json!({})))
                .expect("field set nodes are objects");
        }
    }
    for path in set {
        if let Some(node) = lookup_tree(&mut root, path) {
            if node.as_object().is_some_and(|o| !o.is_empty()) {
                node["."] = json!({});
            }
        }
    }
    root
}

fn lookup_tree<'a>(root: &'a mut Value, path: &Path) -> Option<&'a mut Value> {
    let mut node = root;
    for elem in path {
        node = node.get_mut(elem.as_str())?;
    }
    Some(node)
}

/// `metadata.managedFields` of these managers.
pub fn render(managers: &[Manager]) -> Value {
    Value::Array(
        managers
            .iter()
            .map(|m| {
                let mut entry = json!({
                    "manager": m.manager,
                    "operation": m.operation,
                    "apiVersion": m.api_version,
                    "time": m.time,
                    "fieldsType": "FieldsV1",
                    "fieldsV1": fields_v1(&m.fields),
                });
                if !m.subresource.is_empty() {
                    entry["subresource"] = json!(m.subresource);
                }
                entry
            })
            .collect(),
    )
}

/// Managers by object, kept beside the objects.
pub type Table<K> = BTreeMap<K, Vec<Manager>>;

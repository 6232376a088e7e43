//! What a real API server would check of our CRDs and of the objects sent to
//! them: structural schemas, OpenAPI value validation, and the
//! `x-kubernetes-validations` CEL rules (evaluated by `kube-cel`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;

use super::apiserver::Validator;

/// The checked-in CRDs, by plural.
pub struct Crds {
    /// Each CRD under its plural name.
    pub by_plural: BTreeMap<String, Crd>,
}

/// One checked-in CRD.
pub struct Crd {
    /// Its kind.
    pub kind: String,
    /// Its API group.
    pub group: String,
    /// `openAPIV3Schema` of the single served version.
    pub schema: Value,
    /// The whole CRD document.
    pub doc: Value,
}

/// The directory of the checked-in CRD YAML (`crds/` at the workspace root).
pub fn crds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../crds")
}

/// Loads every `crds/*.yaml`.
pub fn load() -> Crds {
    let dir = crds_dir();
    let mut files = Vec::new();
    for entry in
        std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
    {
        let path = entry.expect("dir entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read CRD");
        files.push((path.display().to_string(), text));
    }
    parse(files)
}

/// The CRDs as the controller generates them (`twig_controller::crd::crd_files`,
/// what `crds/` holds): for tests that run where the source tree is not, as
/// in the nested lab.
pub fn generated() -> Crds {
    let files =
        twig_controller::crd::crd_files().unwrap_or_else(|e| panic!("generating the CRDs: {e}"));
    parse(files)
}

/// CRDs from `(name, YAML)` pairs.
fn parse(files: Vec<(String, String)>) -> Crds {
    let mut by_plural = BTreeMap::new();
    for (name, text) in files {
        let doc: Value = serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        let plural = doc["spec"]["names"]["plural"]
            .as_str()
            .expect("plural")
            .to_string();
        let kind = doc["spec"]["names"]["kind"]
            .as_str()
            .expect("kind")
            .to_string();
        let group = doc["spec"]["group"].as_str().expect("group").to_string();
        let schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone();
        by_plural.insert(
            plural,
            Crd {
                kind,
                group,
                schema,
                doc,
            },
        );
    }
    Crds { by_plural }
}

impl Crds {
    /// Admission as the API server does it for custom resources: schema values, then CEL.
    pub fn validate(&self, plural: &str, obj: &Value, old: Option<&Value>) -> Result<(), String> {
        let Some(crd) = self.by_plural.get(plural) else {
            return Ok(());
        };
        let mut errors = Vec::new();
        value_errors(&crd.schema, obj, "", true, &mut errors);
        if errors.is_empty() {
            if let Err(cel) = kube_cel::Validator::new().validate(&crd.schema, obj, old) {
                errors.extend(cel.iter().map(|e| e.to_string()));
            }
        }
        if errors.is_empty() {
            return Ok(());
        }
        let name = obj["metadata"]["name"].as_str().unwrap_or_default();
        Err(format!(
            "{}.{} \"{name}\" is invalid: [{}]",
            crd.kind,
            crd.group,
            errors.join(", ")
        ))
    }

    /// Every `openAPIV3Schema`, by plural.
    pub fn schemas(&self) -> BTreeMap<String, Value> {
        self.by_plural
            .iter()
            .map(|(plural, crd)| (plural.clone(), crd.schema.clone()))
            .collect()
    }

    /// The admission validator of these CRDs (schemas and CEL rules) for the test API server.
    pub fn validator(self) -> Validator {
        let me = Arc::new(self);
        Arc::new(move |plural, obj, old| me.validate(plural, obj, old))
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// OpenAPI v3 value validation of `value` against a structural `schema`.
pub fn value_errors(schema: &Value, value: &Value, path: &str, root: bool, out: &mut Vec<String>) {
    if value.is_null() {
        if schema["nullable"] != Value::Bool(true) {
            out.push(format!("{path}: Invalid value: null: must not be null"));
        }
        return;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            out.push(format!(
                "{path}: Unsupported value: {value}: supported values: {}",
                Value::Array(allowed.clone())
            ));
        }
    }
    let ty = schema["type"].as_str().unwrap_or_default();
    let type_ok = match ty {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        _ => true,
    };
    if !type_ok {
        out.push(format!(
            "{path}: Invalid value: {value}: must be of type {ty}"
        ));
        return;
    }
    match value {
        Value::Object(map) => {
            for req in schema["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                if !map.contains_key(req) {
                    out.push(format!("{}: Required value", join(path, req)));
                }
            }
            for (k, v) in map {
                if root && matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                    continue;
                }
                if let Some(prop) = schema["properties"].get(k) {
                    value_errors(prop, v, &join(path, k), false, out);
                } else if let Some(additional) =
                    schema.get("additionalProperties").filter(|a| a.is_object())
                {
                    value_errors(additional, v, &join(path, k), false, out);
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                value_errors(&schema["items"], item, &format!("{path}[{i}]"), false, out);
            }
        }
        Value::String(s) => {
            let len = s.chars().count() as u64;
            if schema["minLength"].as_u64().is_some_and(|m| len < m) {
                out.push(format!(
                    "{path}: Invalid value: {value}: should be at least {} chars long",
                    schema["minLength"]
                ));
            }
            if schema["maxLength"].as_u64().is_some_and(|m| len > m) {
                out.push(format!(
                    "{path}: Too long: may not be more than {} bytes",
                    schema["maxLength"]
                ));
            }
            if let Some(pattern) = schema["pattern"].as_str() {
                let re = regex::Regex::new(pattern).expect("pattern compiles");
                if !re.is_match(s) {
                    out.push(format!(
                        "{path}: Invalid value: {value}: should match '{pattern}'"
                    ));
                }
            }
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap_or_default();
            if schema["minimum"].as_f64().is_some_and(|m| x < m) {
                out.push(format!(
                    "{path}: Invalid value: {n}: should be greater than or equal to {}",
                    schema["minimum"]
                ));
            }
            if schema["maximum"].as_f64().is_some_and(|m| x > m) {
                out.push(format!(
                    "{path}: Invalid value: {n}: should be less than or equal to {}",
                    schema["maximum"]
                ));
            }
            if let Some(m) = schema["multipleOf"].as_f64().filter(|m| *m > 0.0) {
                if (x / m).fract() != 0.0 {
                    out.push(format!(
                        "{path}: Invalid value: {n}: should be a multiple of {m}"
                    ));
                }
            }
        }
        _ => {}
    }
}

const ALLOWED_KEYS: &[&str] = &[
    "description",
    "type",
    "format",
    "title",
    "default",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "multipleOf",
    "enum",
    "maxProperties",
    "minProperties",
    "required",
    "items",
    "properties",
    "additionalProperties",
    "nullable",
    "externalDocs",
    "example",
];

const SCALARS: &[&str] = &["string", "integer", "number", "boolean"];

/// Everything that makes `schema` non-structural or otherwise unacceptable to
/// a Kubernetes API server (apiextensions v1), with the path of each problem.
pub fn structural_errors(schema: &Value, path: &str, out: &mut Vec<String>) {
    let Some(map) = schema.as_object() else {
        out.push(format!("{path}: schema is not an object"));
        return;
    };
    for key in map.keys() {
        if matches!(key.as_str(), "anyOf" | "oneOf" | "allOf" | "not") {
            out.push(format!(
                "{path}: {key} is not allowed (ambiguous union; use fields and a CEL rule)"
            ));
        } else if !key.starts_with("x-kubernetes-") && !ALLOWED_KEYS.contains(&key.as_str()) {
            out.push(format!("{path}: {key} is not allowed in a CRD schema"));
        }
    }
    if map.get("uniqueItems") == Some(&Value::Bool(true)) {
        out.push(format!("{path}: uniqueItems cannot be true"));
    }
    let preserve = map.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    let int_or_string = map.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    let ty = map.get("type").and_then(Value::as_str).unwrap_or_default();
    if ty.is_empty() && !preserve && !int_or_string {
        out.push(format!("{path}: type must not be empty"));
    }
    if !ty.is_empty()
        && !matches!(
            ty,
            "object" | "array" | "string" | "integer" | "number" | "boolean"
        )
    {
        out.push(format!("{path}: unknown type {ty}"));
    }
    if map.contains_key("properties") && map.contains_key("additionalProperties") {
        out.push(format!(
            "{path}: properties and additionalProperties are mutually exclusive"
        ));
    }
    if (map.contains_key("properties") || map.contains_key("additionalProperties"))
        && ty != "object"
    {
        out.push(format!("{path}: properties need type object"));
    }
    if map.contains_key("items") != (ty == "array") {
        out.push(format!("{path}: items must be given exactly for arrays"));
    }
    if ty == "object"
        && !preserve
        && !map.contains_key("properties")
        && !map.contains_key("additionalProperties")
    {
        out.push(format!(
            "{path}: an object without properties would have every field pruned"
        ));
    }
    if let Some(default) = map.get("default") {
        let mut errs = Vec::new();
        value_errors(
            schema,
            default,
            &format!("{path}.default"),
            false,
            &mut errs,
        );
        out.extend(errs);
    }
    for req in map
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = req.as_str().unwrap_or_default();
        if map.get("properties").and_then(|p| p.get(name)).is_none() {
            out.push(format!("{path}: required field {name} is not a property"));
        }
    }
    match map.get("x-kubernetes-list-type").and_then(Value::as_str) {
        None => {
            if map.contains_key("x-kubernetes-list-map-keys") {
                out.push(format!(
                    "{path}: x-kubernetes-list-map-keys needs x-kubernetes-list-type map"
                ));
            }
        }
        Some("atomic" | "set") => {
            if ty != "array" {
                out.push(format!("{path}: x-kubernetes-list-type on a non-array"));
            }
        }
        Some("map") => {
            let items = &schema["items"];
            let keys = map
                .get("x-kubernetes-list-map-keys")
                .and_then(Value::as_array);
            match keys {
                None => out.push(format!(
                    "{path}: x-kubernetes-list-type map needs x-kubernetes-list-map-keys"
                )),
                Some(keys) => {
                    for k in keys.iter().filter_map(Value::as_str) {
                        let prop = &items["properties"][k];
                        if !SCALARS.contains(&prop["type"].as_str().unwrap_or_default()) {
                            out.push(format!(
                                "{path}: list map key {k} must be a scalar property of the items"
                            ));
                        }
                        let required = items["required"]
                            .as_array()
                            .is_some_and(|r| r.contains(&Value::from(k)));
                        if !required && prop.get("default").is_none() {
                            out.push(format!(
                                "{path}: list map key {k} must be required or defaulted"
                            ));
                        }
                    }
                }
            }
        }
        Some(other) => out.push(format!("{path}: unknown x-kubernetes-list-type {other}")),
    }
    for rule in map
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if rule["rule"].as_str().is_none_or(str::is_empty) {
            out.push(format!(
                "{path}: x-kubernetes-validations entry without a rule"
            ));
        }
    }
    if let Some(props) = map.get("properties").and_then(Value::as_object) {
        for (k, v) in props {
            structural_errors(v, &join(path, k), out);
        }
    }
    if let Some(additional) = map.get("additionalProperties") {
        if additional.is_object() {
            structural_errors(additional, &format!("{path}[*]"), out);
        }
    }
    if let Some(items) = map.get("items") {
        structural_errors(items, &format!("{path}[]"), out);
    }
}

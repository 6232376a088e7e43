//! ValidatingAdmissionPolicy evaluation as kube-apiserver does it, for the
//! policies the chart ships: a binding names its policy and must `Deny`;
//! the policy's `matchConstraints.resourceRules` select the request by
//! group, version, operation and resource, and its `matchConditions` (CEL
//! over `object`, `oldObject` and `request`) must all hold for it to apply;
//! `variables` are evaluated in order and reachable as `variables.<name>`;
//! every validation is a CEL expression over `object` (null on DELETE),
//! `oldObject` (null on CREATE), `request` (`operation`, `resource`,
//! `userInfo.username` and, when the user has any, `userInfo.extra`, a map
//! of string lists) and `variables`, whose `false` denies with its
//! `messageExpression`, `message` or the expression itself; an expression
//! that fails to evaluate denies under `failurePolicy: Fail` (the default).
//! The CEL is the `cel` crate's, as the testkit's CRD schema checks use it.

use std::collections::{BTreeMap, HashMap};

use cel::{Context, Program, Value as Cel};
use serde_json::Value;

/// One write, as an admission policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// `CREATE`, `UPDATE` or `DELETE`.
    pub operation: &'a str,
    /// The API group (`""` for the core group).
    pub group: &'a str,
    /// The API version (`v1`).
    pub version: &'a str,
    /// The resource's plural (`pods`).
    pub resource: &'a str,
    /// Who sends it (`request.userInfo.username`).
    pub username: &'a str,
    /// What their credentials say besides (`request.userInfo.extra`), e.g. a
    /// bound ServiceAccount token's `authentication.kubernetes.io/node-name`.
    pub extra: &'a BTreeMap<String, Vec<String>>,
    /// The object as it would be stored (`Value::Null` on DELETE).
    pub object: &'a Value,
    /// The stored object an UPDATE replaces.
    pub old_object: Option<&'a Value>,
}

/// What `DELETE` requests carry as `object`.
static NULL: Value = Value::Null;

impl<'a> Request<'a> {
    /// A write of `object` over `old_object` to `resource` (`pods`,
    /// `snapshots/status`) of `group`/`version` by `username`, its operation
    /// as kube-apiserver names it from what the write carries: `CREATE`
    /// (`object` alone), `UPDATE` (both) or `DELETE` (no `object`; it is
    /// `null`, and `old_object` the stored one).
    pub fn write(
        (group, version, resource): (&'a str, &'a str, &'a str),
        username: &'a str,
        extra: &'a BTreeMap<String, Vec<String>>,
        object: Option<&'a Value>,
        old_object: Option<&'a Value>,
    ) -> Request<'a> {
        Request {
            operation: match (object, old_object) {
                (Some(_), None) => "CREATE",
                (Some(_), Some(_)) => "UPDATE",
                (None, _) => "DELETE",
            },
            group,
            version,
            resource,
            username,
            extra,
            object: object.unwrap_or(&NULL),
            old_object,
        }
    }
}

/// What a policy says of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The policy does not match the request, or every validation held.
    Allowed,
    /// A validation failed (or could not be evaluated).
    Denied {
        /// The validation's message.
        message: String,
        /// Its `reason` (`Invalid` unless it names one).
        reason: String,
    },
}

/// The verdict of `policy` (a ValidatingAdmissionPolicy) bound by `binding`
/// on `req`. `Err` for a policy or binding the test API server cannot
/// enforce (a CEL syntax error, a binding of another policy, an action
/// other than `Deny`).
pub fn evaluate(policy: &Value, binding: &Value, req: &Request<'_>) -> Result<Verdict, String> {
    let name = policy["metadata"]["name"].as_str().unwrap_or_default();
    if binding["spec"]["policyName"].as_str() != Some(name) {
        return Err(format!(
            "binding {} does not bind policy {name}",
            binding["metadata"]["name"]
        ));
    }
    let actions = &binding["spec"]["validationActions"];
    if !actions
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x == "Deny"))
    {
        return Err(format!(
            "binding of {name}: validationActions {actions} do not Deny"
        ));
    }
    let spec = &policy["spec"];
    if !matches(&spec["matchConstraints"], req) {
        return Ok(Verdict::Allowed);
    }
    let fail_open = spec["failurePolicy"].as_str() == Some("Ignore");
    let failed = |message: String| {
        if fail_open {
            Ok(Verdict::Allowed)
        } else {
            Ok(Verdict::Denied {
                message,
                reason: "Invalid".into(),
            })
        }
    };
    let mut context = Context::default();
    // kube-apiserver leaves out an empty `extra` (`omitempty`).
    let mut user = serde_json::json!({"username": req.username});
    if !req.extra.is_empty() {
        user["extra"] = serde_json::json!(req.extra);
    }
    for (var, value) in [
        ("object", req.object.clone()),
        ("oldObject", req.old_object.cloned().unwrap_or(Value::Null)),
        (
            "request",
            serde_json::json!({
                "operation": req.operation,
                "userInfo": user,
                "resource": {"group": req.group, "version": req.version, "resource": req.resource},
            }),
        ),
    ] {
        context.add_variable_from_value(var, to_cel(&value)?);
    }
    for condition in spec["matchConditions"].as_array().into_iter().flatten() {
        let expression = condition["expression"].as_str().unwrap_or_default();
        match run(&context, expression)? {
            Ok(Cel::Bool(true)) => continue,
            Ok(Cel::Bool(false)) => return Ok(Verdict::Allowed),
            Ok(other) => return failed(format!("{expression}: {other:?} is not a bool")),
            Err(e) => return failed(format!("match condition {expression}: {e}")),
        }
    }
    let mut variables: HashMap<String, Cel> = HashMap::new();
    for v in spec["variables"].as_array().into_iter().flatten() {
        let var = v["name"].as_str().unwrap_or_default().to_string();
        context.add_variable_from_value("variables", variables.clone());
        match run(&context, v["expression"].as_str().unwrap_or_default())? {
            Ok(value) => variables.insert(var, value),
            Err(e) => return failed(format!("variable {var}: {e}")),
        };
    }
    context.add_variable_from_value("variables", variables);
    for check in spec["validations"].as_array().into_iter().flatten() {
        let expression = check["expression"].as_str().unwrap_or_default();
        match run(&context, expression)? {
            Ok(Cel::Bool(true)) => continue,
            Ok(Cel::Bool(false)) => {}
            Ok(other) => return failed(format!("{expression}: {other:?} is not a bool")),
            Err(e) => return failed(format!("{expression}: {e}")),
        }
        let message = match check["messageExpression"].as_str() {
            Some(m) => match run(&context, m)? {
                Ok(Cel::String(s)) => s.to_string(),
                _ => format!("failed expression: {expression}"),
            },
            None => check["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("failed expression: {expression}")),
        };
        let reason = check["reason"].as_str().unwrap_or("Invalid").to_string();
        return Ok(Verdict::Denied { message, reason });
    }
    Ok(Verdict::Allowed)
}

/// Compiles and runs `expression`: `Err` for one that does not compile
/// (the policy is broken), `Ok(Err)` for one that fails at run time.
fn run(context: &Context<'_>, expression: &str) -> Result<Result<Cel, String>, String> {
    let program = Program::compile(expression).map_err(|e| format!("CEL {expression:?}: {e}"))?;
    Ok(program.execute(context).map_err(|e| e.to_string()))
}

fn to_cel(value: &Value) -> Result<Cel, String> {
    cel::to_value(value).map_err(|e| format!("{value}: {e}"))
}

/// Whether a rule list (`"*"` matches all) holds `value`.
fn listed(rule: &Value, field: &str, value: &str) -> bool {
    rule[field]
        .as_array()
        .is_some_and(|l| l.iter().any(|x| x == "*" || x == value))
}

fn matches(constraints: &Value, req: &Request<'_>) -> bool {
    constraints["resourceRules"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|rule| {
            listed(rule, "apiGroups", req.group)
                && listed(rule, "apiVersions", req.version)
                && listed(rule, "operations", req.operation)
                && listed(rule, "resources", req.resource)
        })
}

//! `kubectl twig wait KIND/NAME`: like `kubectl wait`, for Twig objects.

use kube::Client;

use crate::cli::WaitArgs;
use crate::error::Error;
use crate::kind::Kind;
use crate::output::{emit, print};
use crate::wait::{until, Target};

/// Waits for `--for` on the object, at most `--timeout`; prints `<object> condition met`.
pub async fn wait(client: Client, namespace: &str, args: WaitArgs) -> Result<(), Error> {
    let (kind, name) = args
        .object
        .split_once('/')
        .filter(|(kind, name)| !kind.is_empty() && !name.is_empty() && !name.contains('/'))
        .ok_or_else(|| {
            Error::Usage(format!(
                "{:?}: name the object as KIND/NAME (e.g. snapshot/redis-seeded)",
                args.object
            ))
        })?;
    let kind = Kind::parse(kind)?;
    let target = Target::parse(&args.for_)?;
    let api = kind.api(client, namespace);
    let exists = target != Target::Delete || api.get_opt(name).await?.is_some();
    let seen = until(kind, &api, name, &target, args.timeout).await?;
    if !exists {
        // kubectl wait --for=delete says nothing of an object that was never there.
        return Ok(());
    }
    let object = kind.object_name(name);
    let met = format!("{object} condition met");
    match seen {
        Some(obj) => emit(args.output, &object, &obj, &met),
        None => print(&format!("{met}\n")),
    }
}

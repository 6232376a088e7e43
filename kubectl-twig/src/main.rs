//! `kubectl-twig`, the kubectl plugin of Twig: `kubectl twig snapshot|fork|rewind|tree|wait|net`.
//!
//! On `PATH`, kubectl finds it as the `twig` command. It creates and follows
//! the `twig.dev/v1alpha1` objects the Twig controller reconciles, with the
//! controller's own types, and reads the kubeconfig as kubectl does. Errors
//! are printed as kubectl prints them, and exit with 1.

mod cli;
mod client;
mod create;
mod duration;
mod error;
mod kind;
mod net;
mod output;
mod prom;
mod tree;
mod wait;
mod wait_cmd;

use clap::Parser;

use cli::{Cli, Command};
use error::Error;

fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout with 0; usage errors, as kubectl's, exit 1.
            let code = u8::from(e.use_stderr());
            // Nothing useful is left to do when the terminal is gone.
            let _ = e.print();
            return code.into();
        }
    };
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::Client(format!("starting the async runtime: {e}")))
        .and_then(|runtime| runtime.block_on(run(cli)));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", e.render());
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether the command's requests are retried on 429, 503 and 504. Not
/// `net`'s: a 503 there is the controller that does not answer through the
/// proxy, which the user should hear of at once, not after minutes of
/// retries.
fn retries(command: &Command) -> bool {
    !matches!(command, Command::Net(_))
}

async fn run(cli: Cli) -> Result<(), Error> {
    let client::Cluster {
        client,
        namespace,
        server,
    } = client::connect(&cli.connection, retries(&cli.command)).await?;
    let ns = namespace.as_str();
    match cli.command {
        Command::Snapshot(args) => create::snapshot(client, ns, args).await,
        Command::Fork(args) => create::fork(client, ns, args).await,
        Command::Rewind(args) => create::rewind(client, ns, args).await,
        Command::Tree(args) => tree::tree(client, ns, args.pod, args.output).await,
        Command::Wait(args) => wait_cmd::wait(client, ns, args).await,
        Command::Net(args) => net::net(client, ns, args).await,
    }
    .map_err(|e| e.at_server(&server))
}

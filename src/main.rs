//! The `vkd` binary: parse, set up logging, run, map errors to exit codes
//! (64 for unusable configuration, 1 for a runtime failure).

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;
use vkd::config::{Cli, Command, Config, ProcessCommand, SimCommand};

const EX_USAGE: u8 = 64;

/// jemalloc, counted: `vkd_heap_bytes` reports what the daemon holds. jemalloc
/// gives freed pages back to the kernel, which glibc's arenas do not: at 10,000
/// Pods the RSS was 2.6 times the heap with the system allocator.
#[global_allocator]
static ALLOCATOR: cap::Cap<tikv_jemallocator::Jemalloc> =
    cap::Cap::new(tikv_jemallocator::Jemalloc, usize::MAX);

/// jemalloc's options, read before `main`: one arena and no thread caches (a
/// daemon that mostly waits on the network gains nothing from either), and
/// freed pages go back to the kernel at once. Measured at 10,000 Pods: RSS
/// 39.0 MiB with these, 49.8 MiB with jemalloc's defaults. `_RJEM_MALLOC_CONF`
/// in the environment overrides them.
#[allow(unsafe_code)] // jemalloc finds this by its unmangled name
#[unsafe(export_name = "_rjem_malloc_conf")]
static JEMALLOC_OPTIONS: &u8 = &b"narenas:1,tcache:false,dirty_decay_ms:0,muzzy_decay_ms:0\0"[0];

fn main() -> ExitCode {
    vkd::metrics::set_heap_probe(|| ALLOCATOR.allocated());
    // `vkd process-shim DIR` and `vkd process-launch ..`: the process provider's
    // supervisor and launcher, started by the daemon itself, not by people.
    let argv: Vec<String> = std::env::args().collect();
    if let Some(code) = vkd_process::dispatch(&argv) {
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { EX_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match cli.command {
        Command::Run(args) => run(*args),
        Command::Sim(SimCommand::List {
            state_dir,
            node,
            json,
        }) => sim_list(&state_dir, node.as_deref(), json),
        Command::Sim(SimCommand::Create {
            state_dir,
            node,
            pod,
            uid,
            host,
            epoch,
        }) => sim_create(&state_dir, &node, &pod, uid, &host, epoch),
        Command::Explain(args) => explain(args),
        Command::ProviderServe(args) => provider_serve(&args),
        Command::ProviderConformance(args) => provider_conformance(&args),
        Command::Process(ProcessCommand::List {
            state_dir,
            node,
            json,
        }) => process_list(&state_dir, node.as_deref(), json),
    }
}

fn run(args: vkd::config::RunArgs) -> ExitCode {
    let cfg = match Config::from_args(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vkd: invalid configuration: {e}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let _telemetry = vkd::telemetry::init(cfg.log_format);
    // A plugin is connected in the runtime, below; the others are built now.
    let built = if cfg.provider == vkd::config::ProviderKind::Grpc {
        Ok(None)
    } else {
        vkd::build_provider(&cfg).map(Some)
    };
    let provider = match built {
        Ok(p) => p,
        Err(e @ vkd::Error::Config(_)) => {
            eprintln!("vkd: {e}");
            return ExitCode::from(EX_USAGE);
        }
        Err(e) => {
            eprintln!("vkd: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vkd: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(signals(shutdown.clone()));
        let provider = match provider {
            Some(p) => p,
            None => vkd::connect_provider(&cfg).await?,
        };
        vkd::run(cfg, provider, shutdown).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "vkd stopped");
            eprintln!("vkd: {e}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, ExitCode> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            eprintln!("vkd: starting the async runtime: {e}");
            ExitCode::FAILURE
        })
}

/// `vkd provider-serve`: an in-tree provider behind the provider protocol
/// until SIGTERM.
fn provider_serve(args: &vkd::cli::provider::ProviderServeArgs) -> ExitCode {
    let (kind, endpoint) = match args.checked() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vkd: invalid configuration: {e}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let _telemetry = vkd::telemetry::init(vkd::config::LogFormat::default());
    let runtime = match runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    let result = runtime.block_on(async move {
        let provider = vkd::build_in_tree(kind, args.provider_config.as_deref(), &args.state_dir)?;
        let shutdown = CancellationToken::new();
        tokio::spawn(signals(shutdown.clone()));
        let failed = |message: String| vkd::Error::Provider {
            provider: "provider-serve",
            message,
        };
        let served = vkd_grpc::server::serve(provider, &endpoint, shutdown)
            .await
            .map_err(|e| failed(e.to_string()))?;
        tracing::info!(%endpoint, provider = kind.name(), "serving the provider protocol");
        match served.await {
            Ok(done) => done.map_err(|e| failed(e.to_string())),
            Err(e) => Err(failed(format!("the server task: {e}"))),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ vkd::Error::Config(_)) => {
            eprintln!("vkd: {e}");
            ExitCode::from(EX_USAGE)
        }
        Err(e) => {
            eprintln!("vkd: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `vkd provider-conformance`: every check of the provider kit against a
/// plugin, one line each; exit 0 when all pass, 1 when any fails or the
/// plugin does not answer.
fn provider_conformance(args: &vkd::cli::provider::ProviderConformanceArgs) -> ExitCode {
    let (endpoint, timeout, patience) = match args.checked() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vkd: invalid configuration: {e}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let runtime = match runtime() {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(async move {
        let plugin = match vkd_grpc::GrpcProvider::connect(endpoint, timeout).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("vkd: {e}");
                return ExitCode::FAILURE;
            }
        };
        use vkd_provider::Provider as _;
        println!(
            "plugin {} (capabilities: {})",
            plugin.name(),
            plugin.capabilities().supported().join(", ")
        );
        let mut kit = vkd_provider::conformance::Kit::new(
            &plugin,
            &args.node,
            vkd_provider::conformance::sample_spec,
        );
        kit.patience = patience;
        let report = kit.report().await;
        let failed = report.iter().filter(|(_, r)| r.is_err()).count();
        for (check, result) in &report {
            match result {
                Ok(()) => println!("PASS  {check}"),
                Err(e) => println!("FAIL  {check}: {}", e.message),
            }
        }
        println!(
            "{} of {} checks passed",
            report.len() - failed,
            report.len()
        );
        if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    })
}

/// The first SIGTERM or SIGINT cancels the token; a second one exits at once.
async fn signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    for n in 0..2 {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        if n == 0 {
            tracing::info!("shutting down");
            shutdown.cancel();
        } else {
            std::process::exit(130);
        }
    }
}

/// `vkd explain`: exit 0 with the answer, 1 when it could not be given
/// (refused, not found, unreachable), 64 for a usage error.
fn explain(args: vkd::cli::explain::ExplainArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vkd explain: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(vkd::cli::explain::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ vkd::cli::explain::ExplainError::Usage(_)) => {
            eprintln!("vkd explain: {e}");
            ExitCode::from(EX_USAGE)
        }
        Err(e) => {
            eprintln!("vkd explain: {e}");
            ExitCode::FAILURE
        }
    }
}

fn sim_create(
    state_dir: &std::path::Path,
    node: &str,
    pod: &str,
    uid: Option<String>,
    host: &str,
    epoch: u64,
) -> ExitCode {
    let Some((namespace, name)) = pod.split_once('/') else {
        eprintln!("vkd sim create: --pod must be NAMESPACE/NAME, not {pod:?}");
        return ExitCode::from(EX_USAGE);
    };
    let owner = vkd_provider::PodRef {
        uid: uid.unwrap_or_else(|| uuid::Uuid::new_v4().to_string()),
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    };
    match vkd_sim::create_by_hand(&state_dir.join("sim"), node, owner, host, epoch) {
        Ok(rec) => {
            println!("{}", rec.id);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vkd sim create: {e}");
            ExitCode::FAILURE
        }
    }
}

fn sim_list(state_dir: &std::path::Path, node: Option<&str>, json: bool) -> ExitCode {
    let records = match vkd_sim::read_records(&state_dir.join("sim")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vkd sim list: {e}");
            return ExitCode::FAILURE;
        }
    };
    let records: Vec<_> = records
        .into_iter()
        .filter(|r| node.is_none_or(|n| r.spec.node == n))
        .collect();
    if json {
        let rows: Vec<_> = records
            .iter()
            .map(|r| {
                serde_json::json!({
                    "instance": r.id,
                    "podUID": r.spec.pod.uid,
                    "namespace": r.spec.pod.namespace,
                    "name": r.spec.pod.name,
                    "node": r.spec.node,
                    "epoch": r.epoch,
                    "host": r.placement.host,
                    "gpus": r.placement.gpu_ids,
                    "ip": r.ip,
                    "stopping": r.stop_at.is_some(),
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(rows));
    } else {
        println!(
            "{:<18} {:<38} {:<40} {:<16} {:>11} {:<10} IP",
            "INSTANCE", "POD-UID", "POD", "NODE", "EPOCH", "HOST"
        );
        for r in &records {
            println!(
                "{:<18} {:<38} {:<40} {:<16} {:>11} {:<10} {}",
                r.id,
                r.spec.pod.uid,
                r.spec.pod.to_string(),
                r.spec.node,
                r.epoch,
                r.placement.host,
                r.ip
            );
        }
    }
    ExitCode::SUCCESS
}

fn process_list(state_dir: &std::path::Path, node: Option<&str>, json: bool) -> ExitCode {
    let rows = match vkd_process::read_listings(&state_dir.join("process")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vkd process list: {}: {e}", state_dir.display());
            return ExitCode::FAILURE;
        }
    };
    let rows: Vec<_> = rows
        .into_iter()
        // An unreadable sandbox is shown whatever the node: its node is unknown.
        .filter(|r| r.error.is_some() || node.is_none_or(|n| r.node == n))
        .collect();
    if json {
        match serde_json::to_string(&rows) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("vkd process list: {e}");
                return ExitCode::FAILURE;
            }
        }
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<18} {:<40} {:<16} {:>11} {:<14} PROCESSES",
        "INSTANCE", "POD", "NODE", "EPOCH", "SHIM"
    );
    for r in &rows {
        let shim = match (r.shim_pid, r.shim_alive, r.stopping) {
            (Some(p), true, false) => format!("{p}"),
            (Some(p), true, true) => format!("{p} stopping"),
            (_, false, _) => "exited".to_owned(),
            (None, true, _) => "?".to_owned(),
        };
        let procs: Vec<String> = r
            .processes
            .iter()
            .map(|(c, p)| format!("{c}={p}"))
            .collect();
        println!(
            "{:<18} {:<40} {:<16} {:>11} {:<14} {}",
            r.instance,
            format!("{}/{}", r.namespace, r.name),
            r.node,
            r.epoch,
            shim,
            procs.join(" ")
        );
        if let Some(e) = &r.error {
            println!("  unreadable: {e}");
        }
    }
    ExitCode::SUCCESS
}

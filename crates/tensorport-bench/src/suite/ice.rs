//! The iceoryx2 side: services, ports, and the send and receive every iceoryx2 child uses.

use super::*;

pub(super) fn ice<T, E: std::fmt::Debug>(r: Result<T, E>, what: &str) -> CliResult<T> {
    r.map_err(|e| CliError::new(format!("iceoryx2 {what}: {e:?}")))
}

pub(super) fn service_name(tag: &str) -> CliResult<ServiceName> {
    ice(ServiceName::new(tag), "service name")
}

pub(super) fn ice_node() -> CliResult<Node<ipc::Service>> {
    ice(
        NodeBuilder::new()
            .signal_handling_mode(SignalHandlingMode::Disabled)
            .create::<ipc::Service>(),
        "node",
    )
}

pub(super) type IceSvc =
    iceoryx2::service::port_factory::publish_subscribe::PortFactory<ipc::Service, [u8], ()>;

pub(super) type IceEvent = iceoryx2::service::port_factory::event::PortFactory<ipc::Service>;

pub(super) fn ice_data(
    node: &Node<ipc::Service>,
    tag: &str,
    publishers: usize,
) -> CliResult<IceSvc> {
    ice(
        node.service_builder(&service_name(tag)?)
            .publish_subscribe::<[u8]>()
            .enable_safe_overflow(false)
            .subscriber_max_buffer_size(8)
            .history_size(0)
            .max_publishers(publishers.max(1))
            .max_subscribers(1)
            .open_or_create(),
        "service",
    )
}

pub(super) fn ice_event(node: &Node<ipc::Service>, tag: &str) -> CliResult<IceEvent> {
    ice(
        node.service_builder(&service_name(tag)?)
            .event()
            .open_or_create(),
        "event service",
    )
}

pub(super) fn ice_publisher(
    svc: &IceSvc,
    size: usize,
) -> CliResult<Publisher<ipc::Service, [u8], ()>> {
    ice(
        svc.publisher_builder()
            .initial_max_slice_len(size)
            .backpressure_strategy(BackpressureStrategy::RetryUntilDelivered)
            .create(),
        "publisher",
    )
}

pub(super) fn ice_send(
    p: &Publisher<ipc::Service, [u8], ()>,
    size: usize,
    i: usize,
) -> CliResult<()> {
    let s = ice(p.loan_slice_uninit(size), "loan")?;
    ice(s.write_from_fn(byte_of(i)).send(), "send")?;
    Ok(())
}

/// Waits for the next sample: spinning, or sleeping on `listener` between looks.
pub(super) fn ice_recv(
    sub: &Subscriber<ipc::Service, [u8], ()>,
    listener: Option<&iceoryx2::port::listener::Listener<ipc::Service>>,
    deadline: Instant,
) -> CliResult<usize> {
    let mut spins = 0u32;
    loop {
        if let Some(s) = ice(sub.receive(), "receive")? {
            return Ok(*std::hint::black_box(s.payload().first().unwrap_or(&0)) as usize);
        }
        spins = spins.wrapping_add(1);
        // The clock every 32 looks and a yield every 256, as tensorport's own spin loops do.
        if spins.is_multiple_of(32) && Instant::now() > deadline {
            return Err(CliError::new("iceoryx2: no sample within the deadline"));
        }
        match listener {
            // A bounded wait: a notification sent before the ports saw each other is not lost
            // for long (only warm-up round trips can hit this).
            Some(l) => {
                ice(l.timed_wait(|_| {}, Duration::from_millis(10)), "wait")?;
            }
            None if spins.is_multiple_of(256) => std::thread::yield_now(),
            None => std::hint::spin_loop(),
        }
    }
}

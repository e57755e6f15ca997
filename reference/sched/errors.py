"""Errors of the scheduler: bad configuration, bad requests, unknown tenants."""


class SchedulerError(ValueError):
    """Base class: the message names the problem."""


class ConfigError(SchedulerError):
    """Invalid scheduler, policy or tenant configuration (budget < 1, weight <= 0, ...)."""


class RequestError(SchedulerError):
    """A request that can never be served (empty prompt, longer than the context or the cache,
    ...)."""


class UnknownTenantError(SchedulerError):
    """A tenant or plan that the tenant table does not know."""

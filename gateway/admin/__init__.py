"""The admin dashboard: SQL aggregations (`queries`), session authentication (`auth`), pages and API
(`gateway.controllers.dashboard`)."""

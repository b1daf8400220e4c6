{{- /* The gateway Deployment's spec.replicas; empty leaves the field out.

Under the HPA the chart must not set a count of its own, but leaving the field out of an upgrade drops
it from the live object (server-side apply removes a field its manager stops sending), and the
Deployment falls back to 1 pod until the HPA's first sync. So the live count is sent back as it is,
from a lookup of the Deployment. Where lookup sees no cluster (`helm template`, --dry-run=client, Argo
CD) or no Deployment yet (a first install), it returns nothing and the field is left out. */ -}}
{{- define "corral.gateway.replicas" -}}
{{- if not .Values.gateway.autoscaling.enabled }}
{{- .Values.gateway.replicas }}
{{- else }}
{{- $live := lookup "apps/v1" "Deployment" .Release.Namespace (include "corral.gateway.fullname" .) }}
{{- dig "spec" "replicas" "" $live }}
{{- end }}
{{- end }}

{{- define "tardigrade.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tardigrade.labels" -}}
app.kubernetes.io/name: tardigrade-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tardigrade.selectorLabels" -}}
app.kubernetes.io/name: tardigrade-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tardigrade.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tardigrade.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules for the TrainingJobs and their children; shared by the Role and ClusterRole. */}}
{{- define "tardigrade.jobRules" -}}
- apiGroups: [tardigrade.dev]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch, update]
- apiGroups: [tardigrade.dev]
  resources: [trainingjobs/status]
  verbs: [get, patch, update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
